-- Driven by cmd/e2e TestNeovimStatuslineCountsDownToTheIdleStop: nvim
-- --headless -u NONE, contrib/nvim on 'runtimepath', cwd in a checkout
-- whose sandbox is ready and whose daemon has a short idle_stop. It writes
-- what it saw to $NOOK_NVIM_OUT (JSON) and quits; a failure is "error".
local out = {}
local function finish()
  local f = io.open(os.getenv('NOOK_NVIM_OUT'), 'w')
  f:write(vim.json.encode(out))
  f:close()
  vim.cmd('qa!')
end
local function wait(ms, cond, what)
  if not vim.wait(ms, cond, 20) then error('timed out waiting for ' .. what .. ' (statusline ' .. require('nook').statusline() .. ')', 0) end
end

local ok, err = xpcall(function()
  vim.cmd('runtime plugin/nook.lua')
  local nook = require('nook')
  nook.setup()
  wait(10000, function() return nook._state.connected end, 'the event stream')
  wait(10000, function() return nook.statusline() == 'nook:ready' end, 'a ready statusline')

  -- 1. The idle warning shows as a countdown, which counts down.
  wait(60000, function() return nook.statusline():find('idle stop in', 1, true) ~= nil end, 'the idle countdown')
  out.countdown_first = nook.statusline()
  vim.wait(2100, function() return false end, 50)
  out.countdown_later = nook.statusline()

  -- 2. Any use clears it.
  local done
  nook.exec('true', { on_exit = function() done = true end })
  wait(30000, function() return done end, 'the exec')
  -- The exec's end may reach the statusline after on_exit ("running").
  wait(10000, function() return nook.statusline() == 'nook:ready' end, 'the countdown to clear and the exec to end')
  out.after_use = nook.statusline()
end, debug.traceback)
if not ok then out.error = err end
finish()
