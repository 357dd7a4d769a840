if vim.g.loaded_nook then return end
vim.g.loaded_nook = true
vim.api.nvim_create_user_command('Nook', function(o) require('nook').command(o.args) end, {
  nargs = '+',
  complete = function(a, l) return require('nook').complete(a, l) end,
  desc = 'sandboxd: exec, status, list, stop, reset, push, quickfix',
})
