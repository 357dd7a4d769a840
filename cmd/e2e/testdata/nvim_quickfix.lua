-- Driven by cmd/e2e TestNeovimQuickfixReadsPythonTracebacksInTheCheckout:
-- nvim --headless -u NONE with contrib/nvim on 'runtimepath', its cwd the
-- checkout. It runs a Python script that fails (by its sandbox path),
-- fills the quickfix list, and writes the valid entries (file as an
-- absolute path, line) to $NOOK_NVIM_OUT (JSON); any failure is an "error".
local out = {}
local ok, err = xpcall(function()
  vim.cmd('runtime plugin/nook.lua')
  local nook = require('nook')
  nook.setup()
  vim.cmd('Nook exec python3 "$PWD/pkg/boom.py"')
  local buf = vim.api.nvim_get_current_buf()
  if not vim.wait(60000, function() return nook._execs[buf] and nook._execs[buf].done end, 20) then
    error('timed out waiting for the exec to end', 0)
  end
  out.text = table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n')
  vim.cmd('Nook quickfix')
  out.quickfix = {}
  for _, item in ipairs(vim.fn.getqflist()) do
    if item.valid == 1 then
      table.insert(out.quickfix, { file = vim.fn.fnamemodify(vim.fn.bufname(item.bufnr), ':p'), lnum = item.lnum })
    end
  end
end, debug.traceback)
if not ok then out.error = tostring(err) end
local f = io.open(os.getenv('NOOK_NVIM_OUT'), 'w')
f:write(vim.json.encode(out))
f:close()
vim.cmd('qa!')
