if vim.g.loaded_sbx then return end
vim.g.loaded_sbx = true
vim.api.nvim_create_user_command('Sbx', function(o) require('sbx').command(o.args) end, {
  nargs = '+',
  complete = function(a, l) return require('sbx').complete(a, l) end,
  desc = 'sandboxd: exec, status, list, stop, reset, push, quickfix',
})
