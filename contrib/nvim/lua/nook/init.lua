-- nook.nvim: sandboxd from Neovim, over the daemon's socket (see
-- contrib/nvim/README.md). :Nook exec streams a command's output into a
-- buffer; :Nook status|list|stop|reset; a statusline fed by /v1/events.
local http = require('nook.http')
local M = {}

-- state is what the statusline shows, fed by the event stream.
local state = { sessions = {}, running = {}, queued = {}, drift = {}, idle = {}, events = nil, connected = false, last = nil }
M._state = state

local function notify(msg, level)
  vim.notify('nook: ' .. msg, level or vim.log.levels.INFO)
end

local function cwd() return vim.fn.getcwd() end

local function target() return { cwd = cwd() } end

-- exec ------------------------------------------------------------------

local ns = vim.api.nvim_create_namespace('nook')
vim.api.nvim_set_hl(0, 'NookStderr', { default = true, link = 'WarningMsg' })
vim.api.nvim_set_hl(0, 'NookExit', { default = true, link = 'Comment' })
vim.api.nvim_set_hl(0, 'NookExitFail', { default = true, link = 'ErrorMsg' })

-- execs maps a buffer to its running exec.
local execs = {}
M._execs = execs

local function append(buf, text, hl)
  if not vim.api.nvim_buf_is_valid(buf) then return end
  local e = execs[buf]
  local lines = vim.split(text, '\n', { plain = true })
  local last = vim.api.nvim_buf_line_count(buf)
  local first = last - 1
  local cur = vim.api.nvim_buf_get_lines(buf, first, last, false)[1] or ''
  local start_col = #cur
  if e and e.fresh then
    -- The buffer's first line is empty: write over it.
    e.fresh = false
  end
  lines[1] = cur .. lines[1]
  vim.bo[buf].modifiable = true
  vim.api.nvim_buf_set_lines(buf, first, last, false, lines)
  vim.bo[buf].modifiable = false
  if hl then
    for i = 0, #lines - 1 do
      local row = first + i
      local s = (i == 0) and start_col or 0
      local len = #lines[i + 1]
      if len > s then
        vim.api.nvim_buf_add_highlight(buf, ns, hl, row, s, len)
      end
    end
  end
  for _, win in ipairs(vim.fn.win_findbuf(buf)) do
    vim.api.nvim_win_set_cursor(win, { vim.api.nvim_buf_line_count(buf), 0 })
  end
end

-- pythonEfm reads the frames of a Python traceback
-- (  File "/path/x.py", line 3, in f).
local pythonEfm = [[%\s%#File "%f"\, line %l%.%#]]

-- localPaths maps the sandbox's paths in lines to the local checkout's:
-- a local sandbox's checkout is …/runs/<id>/workspace.
local function localPaths(lines, root)
  if not root or root == '' then return lines end
  local repl = (root .. '/'):gsub('%%', '%%%%')
  local out = {}
  for i, l in ipairs(lines) do
    out[i] = l:gsub('[^%s"\':]*/runs/[^/%s"\']+/workspace/', repl)
  end
  return out
end

-- checkoutRoot is the git checkout holding dir, or nil.
local function checkoutRoot(dir)
  local r = vim.fn.systemlist({ 'git', '-C', dir, 'rev-parse', '--show-toplevel' })
  if vim.v.shell_error ~= 0 or not r[1] or r[1] == '' then return nil end
  return r[1]
end

-- exec runs cmd (a shell line) in the sandbox of the current directory and
-- streams its output into a scratch buffer. Returns the buffer.
function M.exec(cmd, opts)
  opts = opts or {}
  local buf = vim.api.nvim_create_buf(true, true)
  pcall(vim.api.nvim_buf_set_name, buf, 'nook://exec/' .. buf .. '/' .. cmd)
  vim.bo[buf].buftype = 'nofile'
  vim.bo[buf].bufhidden = 'hide'
  vim.bo[buf].swapfile = false
  vim.bo[buf].filetype = 'nook'
  vim.bo[buf].modifiable = false
  if not opts.background then
    vim.cmd('botright split')
    vim.api.nvim_win_set_buf(0, buf)
  end
  local e = { cmd = cmd, fresh = true, done = false, root = checkoutRoot(cwd()) }
  execs[buf] = e
  vim.keymap.set('n', '<C-c>', function() M.interrupt(buf) end, { buffer = buf, desc = 'nook: interrupt the command' })
  local argv = { 'sh', '-c', cmd }
  local req = { cwd = cwd(), argv = argv }
  if opts.no_sync then req.noSync = true end
  e.handle = http.request({
    method = 'POST', path = '/v1/exec', stream = true, body = req,
    on_line = function(f)
      if f.type == 'stdout' then
        append(buf, http.base64_decode(f.data or ''))
      elseif f.type == 'stderr' then
        append(buf, http.base64_decode(f.data or ''), 'NookStderr')
      elseif f.type == 'queued' and (f.position or 0) > 0 then
        notify(string.format('waiting for the sandbox (%d ahead)', f.position))
      elseif f.type == 'warning' then
        notify(f.message or '', vim.log.levels.WARN)
      elseif f.type == 'exit' or f.type == 'error' then
        e.done = true
        e.handle.finish()
        local line, hl
        if f.type == 'exit' then
          local r = f.result or {}
          e.exit_code = r.exitCode
          e.signal = r.signal
          line = string.format('[exit %d%s, %d ms]', r.exitCode or -1, r.signal and r.signal ~= vim.NIL and (' signal ' .. r.signal) or '', r.durationMs or 0)
          hl = (r.exitCode == 0) and 'NookExit' or 'NookExitFail'
        else
          e.error = f.error and f.error.message or 'the exec failed'
          line = '[nook: ' .. e.error .. ']'
          hl = 'NookExitFail'
        end
        local last = vim.api.nvim_buf_get_lines(buf, -2, -1, false)[1] or ''
        append(buf, (last ~= '' and '\n' or '') .. line, hl)
        if opts.on_exit then opts.on_exit(e) end
      end
    end,
    on_done = function(err)
      if not e.done then
        e.done = true
        e.error = err or 'the exec stream ended without a result'
        append(buf, '\n[nook: ' .. e.error .. ']', 'NookExitFail')
        if opts.on_exit then opts.on_exit(e) end
      end
    end,
  })
  return buf
end

-- interrupt sends SIGINT to the command of buf (Ctrl-C in its buffer).
function M.interrupt(buf)
  local e = execs[buf or vim.api.nvim_get_current_buf()]
  if not e or e.done then notify('no command is running in this buffer'); return end
  e.handle.send({ signal = 'INT' })
end

-- quickfix fills the quickfix list from an exec buffer's output with
-- Python tracebacks' frames and 'errorformat' (default: the current
-- buffer, else the last exec), the sandbox's paths mapped to the
-- checkout's.
function M.quickfix(buf)
  buf = buf or vim.api.nvim_get_current_buf()
  if not execs[buf] then
    local last
    for b in pairs(execs) do if not last or b > last then last = b end end
    buf = last
  end
  if not buf or not vim.api.nvim_buf_is_valid(buf) then notify('no exec output yet: run :Nook exec first', vim.log.levels.WARN); return end
  local lines = localPaths(vim.api.nvim_buf_get_lines(buf, 0, -1, false), execs[buf].root)
  vim.fn.setqflist({}, ' ', { title = 'nook: ' .. execs[buf].cmd, lines = lines, efm = pythonEfm .. ',' .. vim.o.errorformat })
  vim.cmd('copen')
end

-- plain commands ----------------------------------------------------------

local function show(lines)
  for _, l in ipairs(lines) do vim.api.nvim_echo({ { l } }, true, {}) end
end

function M.status(cb)
  http.call('GET', '/v1/status', nil, target(), function(err, r)
    if cb then return cb(err, r) end
    if err then return notify(err, vim.log.levels.ERROR) end
    local s = r.session or {}
    show({ string.format('nook: %s  run %s  branch %s  (%s)', r.probe, s.runId or '-', s.branch or '-', r.detail or (r.lifecycle and r.lifecycle.state) or '') })
  end)
end

function M.list(cb)
  http.call('GET', '/v1/sessions', nil, nil, function(err, r)
    if cb then return cb(err, r) end
    if err then return notify(err, vim.log.levels.ERROR) end
    local lines = {}
    for _, s in ipairs(r.sessions or {}) do
      table.insert(lines, string.format('%-10s %s  %s@%s', s.status, s.runId, vim.fn.fnamemodify(s.repoRoot, ':t'), s.branch))
    end
    if #lines == 0 then lines = { 'nook: no sandboxes' } end
    show(lines)
  end)
end

function M.stop(cb)
  http.call('POST', '/v1/sessions/stop', target(), nil, function(err, r)
    if cb then return cb(err, r) end
    if err then return notify(err, vim.log.levels.ERROR) end
    notify(string.format('stopped %d sandbox(es)', #(r.stopped or {})))
  end)
end

function M.reset(cb)
  local req = target()
  http.call('POST', '/v1/sessions/reset', req, nil, function(err, r)
    if cb then return cb(err, r) end
    if err then return notify(err, vim.log.levels.ERROR) end
    notify('new sandbox ' .. ((r.session or {}).runId or '') .. (r.replaced and (' (replaced ' .. r.replaced .. ')') or ''))
  end)
end

-- push syncs local changes to the sandbox without running anything, when
-- the daemon has the route (POST /v1/push).
function M.push(cb)
  http.call('POST', '/v1/push', target(), nil, function(err, r)
    if cb then return cb(err, r) end
    if err then return notify(err .. ' (needs a sandboxd with push)', vim.log.levels.ERROR) end
    notify('pushed')
  end)
end

-- statusline --------------------------------------------------------------

local function session_here()
  local dir = cwd()
  local best
  for id, s in pairs(state.sessions) do
    if s.repoRoot and s.repoRoot ~= '' and (dir == s.repoRoot or dir:sub(1, #s.repoRoot + 1) == s.repoRoot .. '/') then
      if not best or #s.repoRoot > #state.sessions[best].repoRoot then best = id end
    end
  end
  return best
end

-- epoch parses an RFC 3339 time ("2026-11-27T15:04:05.5+01:00") to Unix
-- seconds, independently of the local time zone; nil when it is not one.
local function epoch(ts)
  if type(ts) ~= 'string' then return nil end
  local y, mo, d, h, mi, sec, rest = ts:match('^(%d+)-(%d+)-(%d+)T(%d+):(%d+):(%d+)%.?%d*(.*)$')
  if not y then return nil end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  -- Days from the civil date (proleptic Gregorian).
  if mo <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * (mo + (mo > 2 and -3 or 9)) + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  local days = era * 146097 + doe - 719468
  local t = days * 86400 + tonumber(h) * 3600 + tonumber(mi) * 60 + tonumber(sec)
  if rest == 'Z' or rest == 'z' then return t end
  local sign, oh, om = rest:match('^([+-])(%d%d):(%d%d)$')
  if not sign then return nil end
  local off = tonumber(oh) * 3600 + tonumber(om) * 60
  return sign == '+' and t - off or t + off
end
M._epoch = epoch

-- The idle countdown redraws the statusline every second while a
-- session.idle_warning stands.
local idle_timer
local function idle_tick()
  if next(state.idle) == nil then
    if idle_timer then idle_timer:stop(); idle_timer:close(); idle_timer = nil end
    return
  end
  if idle_timer then return end
  idle_timer = vim.loop.new_timer()
  idle_timer:start(1000, 1000, vim.schedule_wrap(function() vim.cmd('redrawstatus') end))
end

local function on_event(ev)
  state.last = ev
  local id = ev.sessionId
  if ev.type == 'stream.closed' then return end
  if not id or id == '' or id == vim.NIL then return end
  -- An idle warning stands until anything else happens to its session
  -- (an exec, a push, a connection, the stop itself).
  local stops = ev.type == 'session.idle_warning' and type(ev.data) == 'table' and epoch(ev.data.stopsAt) or nil
  state.idle[id] = stops
  idle_tick()
  local s = state.sessions[id] or { status = 'unknown' }
  state.sessions[id] = s
  local t = ev.type
  -- A session that ended stays ended: its connection's last word (the
  -- daemon closes it as it stops) may come after the stop.
  local ended = s.status == 'stopped' or s.status == 'expired'
  if t == 'session.created' then s.status = 'starting'
  elseif t == 'session.ready' or t == 'session.adopted' then s.status = 'ready'
  elseif t == 'connection.up' then if not ended then s.status = 'ready' end
  elseif t == 'connection.down' then if not ended then s.status = 'disconnected' end
  elseif t == 'session.expired' then s.status = 'expired'
  elseif t == 'session.stopped' or t == 'session.pruned' then s.status = 'stopped'
  elseif t == 'exec.queued' then state.queued[id] = (state.queued[id] or 0) + 1
  elseif t == 'exec.started' then
    state.queued[id] = math.max((state.queued[id] or 1) - 1, 0)
    state.running[id] = (state.running[id] or 0) + 1
  elseif t == 'exec.finished' then state.running[id] = math.max((state.running[id] or 1) - 1, 0)
  elseif t == 'config.drift' then state.drift[id] = true
  end
  if t == 'session.created' or t == 'session.stopped' then state.drift[id] = nil end
  if (t == 'session.created' or t == 'session.adopted') and not s.repoRoot then M.refresh() end
  vim.cmd('redrawstatus')
end

-- refresh reloads the sessions (repository roots) from GET /v1/sessions;
-- with resync (the event stream was just (re)opened, so events may have
-- been missed) the daemon's status of each session replaces ours.
function M.refresh(cb, resync)
  -- With resync, ended sessions too: a stop missed while the stream was
  -- down must show.
  http.call('GET', resync and '/v1/sessions?all=true' or '/v1/sessions', nil, nil, function(err, r)
    if not err then
      for _, s in ipairs(r.sessions or {}) do
        local cur = state.sessions[s.id] or {}
        cur.repoRoot, cur.branch, cur.runId = s.repoRoot, s.branch, s.runId
        cur.status = cur.status or s.status
        if resync or cur.status == 'unknown' or not cur.seen then cur.status = s.status end
        cur.seen = true
        if s.configDrift then state.drift[s.id] = true end
        state.sessions[s.id] = cur
      end
      vim.cmd('redrawstatus')
    end
    if cb then cb(err) end
  end)
end

-- follow subscribes to /v1/events (once); it reconnects after a drop.
function M.follow()
  if state.events then return end
  state.events = http.request({
    method = 'GET', path = '/v1/events',
    on_line = function(ev) state.connected = true; on_event(ev) end,
    on_done = function()
      state.events, state.connected = nil, false
      if M._stopped then return end
      vim.defer_fn(function() M.follow() end, 2000)
    end,
  })
  M.refresh(nil, true)
end

-- countdown words the time left before an idle stop: "58s", "1m05s".
local function countdown(secs)
  secs = math.max(math.floor(secs), 0)
  if secs < 60 then return secs .. 's' end
  return string.format('%dm%02ds', math.floor(secs / 60), secs % 60)
end

-- statusline is for 'statusline': "nook:ready", "running" while an exec
-- runs, "queued:N" for queued execs, "drift" when the sandbox config
-- changed since it started, "idle stop in 58s" after a
-- session.idle_warning until the sandbox is used again.
function M.statusline()
  if not state.events then pcall(M.follow) end
  local id = session_here()
  if not id then return state.connected and 'nook:-' or '' end
  local s = state.sessions[id]
  local parts = { 'nook:' .. (s.status or '?') }
  if (state.running[id] or 0) > 0 then table.insert(parts, 'running') end
  if (state.queued[id] or 0) > 0 then table.insert(parts, 'queued:' .. state.queued[id]) end
  if state.drift[id] then table.insert(parts, 'drift') end
  if state.idle[id] then table.insert(parts, 'idle stop in ' .. countdown(state.idle[id] - os.time())) end
  return table.concat(parts, ' ')
end

-- :Nook ----------------------------------------------------------------------

local subcommands = {
  exec = function(args)
    if args == '' then return notify('usage: :Nook exec {command}', vim.log.levels.ERROR) end
    M.exec(args)
  end,
  status = function() M.status() end,
  list = function() M.list() end,
  stop = function() M.stop() end,
  reset = function() M.reset() end,
  push = function() M.push() end,
  quickfix = function() M.quickfix() end,
  interrupt = function() M.interrupt() end,
}

function M.command(line)
  local sub, rest = line:match('^%s*(%S+)%s*(.-)%s*$')
  local f = sub and subcommands[sub]
  if not f then
    return notify('usage: :Nook exec {cmd} | status | list | stop | reset | push | quickfix | interrupt', vim.log.levels.ERROR)
  end
  f(rest or '')
end

function M.complete(arglead, cmdline)
  if cmdline:match('^%s*%S+%s+%S+%s') then return {} end
  local out = {}
  for k in pairs(subcommands) do if k:sub(1, #arglead) == arglead then table.insert(out, k) end end
  table.sort(out)
  return out
end

function M.setup(opts)
  opts = opts or {}
  if opts.events ~= false then M.follow() end
end

return M
