-- Driven by cmd/e2e TestNeovimPlugin: nvim --headless -u NONE, with
-- contrib/nvim on 'runtimepath', cwd in a checkout. It writes what it saw
-- to $NOOK_NVIM_OUT (JSON) and quits; any failure is an "error" entry.
local out = {}
local function finish()
  local f = io.open(os.getenv('NOOK_NVIM_OUT'), 'w')
  f:write(vim.json.encode(out))
  f:close()
  vim.cmd('qa!')
end
local function fail(msg) out.error = msg; finish() end
local function wait(ms, cond, what)
  if not vim.wait(ms, cond, 20) then error('timed out waiting for ' .. what, 0) end
end
local function text(buf) return table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n') end

local ok, err = xpcall(function()
  vim.cmd('runtime plugin/nook.lua')
  local nook = require('nook')
  nook.setup()
  wait(10000, function() return nook._state.connected or nook._state.events ~= nil end, 'the event stream')

  -- 1. Streaming: the first line shows before the command ends.
  local flag = os.getenv('NOOK_NVIM_FLAG')
  vim.cmd('Nook exec echo first; echo to-stderr >&2; while [ ! -f ' .. flag .. ' ]; do sleep 0.05; done; echo second; exit 3')
  local buf = vim.api.nvim_get_current_buf()
  wait(30000, function() return text(buf):find('first', 1, true) ~= nil end, 'the first line')
  out.before_end = text(buf)
  out.done_before_end = nook._execs[buf].done
  -- The statusline follows the event stream (its own connection).
  wait(30000, function() return nook.statusline():find('running', 1, true) ~= nil end, 'running in the statusline')
  out.statusline_running = nook.statusline()
  io.open(flag, 'w'):close()
  wait(30000, function() return nook._execs[buf].done end, 'the exit')
  out.streamed = text(buf)
  out.exit_code = nook._execs[buf].exit_code
  -- Which lines carry the stderr highlight.
  local marks = vim.api.nvim_buf_get_extmarks(buf, vim.api.nvim_create_namespace('nook'), 0, -1, { details = true })
  out.stderr_lines = {}
  for _, m in ipairs(marks) do
    if m[4].hl_group == 'NookStderr' then table.insert(out.stderr_lines, vim.api.nvim_buf_get_lines(buf, m[2], m[2] + 1, false)[1]) end
  end

  -- 2. Ctrl-C in the buffer interrupts the remote command.
  vim.cmd('Nook exec echo waiting; sleep 300')
  local buf2 = vim.api.nvim_get_current_buf()
  wait(30000, function() return text(buf2):find('waiting', 1, true) ~= nil end, 'the command to start')
  vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes('<C-c>', true, false, true), 'x', false)
  wait(30000, function() return nook._execs[buf2].done end, 'the interrupted command to end')
  out.interrupted = text(buf2)
  out.interrupted_code = nook._execs[buf2].exit_code

  -- 3. Quickfix from the output.
  vim.cmd('Nook exec printf "README.md:1: something is wrong\\n"')
  local buf3 = vim.api.nvim_get_current_buf()
  wait(30000, function() return nook._execs[buf3].done end, 'the quickfix exec')
  vim.cmd('Nook quickfix')
  local qf = vim.fn.getqflist()
  out.quickfix = {}
  for _, item in ipairs(qf) do
    if item.valid == 1 then table.insert(out.quickfix, { file = vim.fn.bufname(item.bufnr), lnum = item.lnum, text = item.text }) end
  end

  -- 4. status, list, and the statusline after a config change (drift).
  local st
  nook.status(function(e, r) st = { err = e, r = r } end)
  wait(30000, function() return st ~= nil end, 'status')
  out.status = st.r and st.r.probe or st.err
  local ls
  nook.list(function(e, r) ls = { err = e, r = r } end)
  wait(30000, function() return ls ~= nil end, 'list')
  out.list_count = ls.r and #ls.r.sessions or -1
  wait(30000, function() return nook.statusline() == 'nook:ready' end, 'an idle statusline')
  out.statusline_idle = nook.statusline()
  local cfg = io.open('.rwx/sandbox.yml', 'a'); cfg:write('# changed\n'); cfg:close()
  wait(30000, function() return nook.statusline():find('drift', 1, true) ~= nil end, 'the drift in the statusline')
  out.statusline_drift = nook.statusline()

  -- 5. :checkhealth nook.
  vim.cmd('checkhealth nook')
  out.health = text(vim.api.nvim_get_current_buf())

  -- 6. stop.
  local sp
  nook.stop(function(e, r) sp = { err = e, r = r } end)
  wait(30000, function() return sp ~= nil end, 'stop')
  out.stopped = sp.r and #sp.r.stopped or -1
  wait(30000, function() return nook.statusline():find('stopped', 1, true) ~= nil end, 'stopped in the statusline')
  out.statusline_stopped = nook.statusline()
end, debug.traceback)
if not ok then return fail(err) end
finish()
