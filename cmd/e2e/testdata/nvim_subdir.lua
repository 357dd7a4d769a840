-- Driven by cmd/e2e TestNeovimExecRunsInTheSubdirectory: nvim --headless
-- -u NONE with contrib/nvim on 'runtimepath' and its cwd in a subdirectory
-- of a checkout. It writes the exec buffer's text and exit code to
-- $NOOK_NVIM_OUT (JSON) and quits; any failure is an "error" entry.
local out = {}
local ok, err = xpcall(function()
  vim.cmd('runtime plugin/nook.lua')
  local nook = require('nook')
  nook.setup()
  vim.cmd('Nook exec cat here.txt')
  local buf = vim.api.nvim_get_current_buf()
  if not vim.wait(60000, function() return nook._execs[buf] and nook._execs[buf].done end, 20) then
    error('timed out waiting for the exec to end', 0)
  end
  out.text = table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n')
  out.exit_code = nook._execs[buf].exit_code
end, debug.traceback)
if not ok then out.error = tostring(err) end
local f = io.open(os.getenv('NOOK_NVIM_OUT'), 'w')
f:write(vim.json.encode(out))
f:close()
vim.cmd('qa!')
