-- HTTP/1.1 over sandboxd's Unix socket with vim.loop (libuv): plain JSON
-- requests and NDJSON streams, no subprocess. Works on Neovim 0.7.
local uv = vim.loop
local M = {}

local function json_encode(v)
  if vim.json then return vim.json.encode(v) end
  return vim.fn.json_encode(v)
end

local function json_decode(s)
  if vim.json then return vim.json.decode(s) end
  return vim.fn.json_decode(s)
end

M.json_encode = json_encode
M.json_decode = json_decode

-- socket_path is where sandboxd listens, as nook finds it.
function M.socket_path()
  local env = os.getenv('SANDBOXD_SOCKET')
  if env and env ~= '' then return env end
  local rt = os.getenv('XDG_RUNTIME_DIR')
  if rt and rt ~= '' then return rt .. '/sandboxd/sandboxd.sock' end
  return '/tmp/sandboxd-' .. tostring(uv.getuid()) .. '/sandboxd.sock'
end

-- A response parser fed with raw bytes: status, headers, then the body
-- (chunked or Content-Length), handed on as it arrives.
local function new_parser(on_head, on_body, on_end)
  local p = { buf = '', state = 'head', chunk_left = nil, length = nil }
  function p.feed(data)
    p.buf = p.buf .. data
    while true do
      if p.state == 'head' then
        local i = p.buf:find('\r\n\r\n', 1, true)
        if not i then return end
        local head = p.buf:sub(1, i - 1)
        p.buf = p.buf:sub(i + 4)
        local status = tonumber(head:match('^HTTP/1%.%d (%d+)'))
        local headers = {}
        for k, v in head:gmatch('\r\n([^:\r\n]+):%s*([^\r\n]*)') do headers[k:lower()] = v end
        p.status = status
        on_head(status, headers)
        if (headers['transfer-encoding'] or ''):lower():find('chunked') then
          p.state = 'chunked'
        else
          p.length = tonumber(headers['content-length'] or '')
          p.state = 'plain'
        end
      elseif p.state == 'plain' then
        if #p.buf > 0 then
          local take = p.buf
          if p.length then take = p.buf:sub(1, p.length); p.length = p.length - #take end
          p.buf = ''
          on_body(take)
        end
        if p.length == 0 then p.state = 'done'; on_end() end
        return
      elseif p.state == 'chunked' then
        if p.chunk_left == nil then
          local i = p.buf:find('\r\n', 1, true)
          if not i then return end
          local size = tonumber(p.buf:sub(1, i - 1):match('^%x+'), 16)
          p.buf = p.buf:sub(i + 2)
          if size == 0 then p.state = 'done'; on_end(); return end
          p.chunk_left = size
        end
        if #p.buf < p.chunk_left + 2 then
          -- Hand on what there is of the chunk, keep the rest for later.
          if #p.buf > 0 and #p.buf <= p.chunk_left then
            on_body(p.buf)
            p.chunk_left = p.chunk_left - #p.buf
            p.buf = ''
          end
          return
        end
        on_body(p.buf:sub(1, p.chunk_left))
        p.buf = p.buf:sub(p.chunk_left + 3)
        p.chunk_left = nil
      else
        return
      end
    end
  end
  -- eof: the connection closed; a body without length ends here.
  function p.eof()
    if p.state == 'plain' and p.length == nil then p.state = 'done'; on_end() end
    return p.state == 'done'
  end
  return p
end

local function query_string(q)
  if not q then return '' end
  local parts = {}
  for k, v in pairs(q) do
    if v ~= nil and v ~= '' then
      local s = tostring(v):gsub('[^%w%-%._~/]', function(c) return string.format('%%%02X', c:byte()) end)
      table.insert(parts, k .. '=' .. s)
    end
  end
  table.sort(parts)
  if #parts == 0 then return '' end
  return '?' .. table.concat(parts, '&')
end

-- open connects and sends a request. opts: method, path, query, body (a
-- table, sent as JSON), stream (body sent chunked: the returned handle's
-- send(frame) and finish() write more), on_line(tbl) for NDJSON answers,
-- on_done(err, status, body) at the end (body: decoded JSON, or nil for a
-- stream). Callbacks run on the main loop (vim.schedule).
function M.request(opts)
  local pipe = uv.new_pipe(false)
  local h = { closed = false }
  local raw = {}
  local line_buf = ''
  local status
  local ndjson = false
  local finished = false

  local function done(err)
    if finished then return end
    finished = true
    if not h.closed then h.closed = true; pipe:read_stop(); pipe:close() end
    local body
    if not err and not ndjson then
      local text = table.concat(raw)
      if text ~= '' then
        local ok, v = pcall(json_decode, text)
        if ok then body = v else err = 'sandboxd answered something that is not JSON: ' .. text:sub(1, 200) end
      end
    end
    if not err and status and (status < 200 or status > 299) then
      local msg = body and body.error and body.error.message or ('sandboxd answered ' .. tostring(status))
      err = msg
    end
    if opts.on_done then vim.schedule(function() opts.on_done(err, status, body) end) end
  end

  local parser = new_parser(function(st, headers)
    status = st
    ndjson = st >= 200 and st <= 299 and (headers['content-type'] or ''):find('ndjson') ~= nil
  end, function(data)
    if not ndjson then table.insert(raw, data); return end
    line_buf = line_buf .. data
    while true do
      local i = line_buf:find('\n', 1, true)
      if not i then break end
      local line = line_buf:sub(1, i - 1)
      line_buf = line_buf:sub(i + 1)
      if line ~= '' and opts.on_line then
        local ok, v = pcall(json_decode, line)
        if ok then vim.schedule(function() opts.on_line(v) end) end
      end
    end
  end, function() done(nil) end)

  local method = opts.method or 'GET'
  local head = method .. ' ' .. opts.path .. query_string(opts.query) .. ' HTTP/1.1\r\n'
    .. 'Host: sandboxd\r\nUser-Agent: nook.nvim\r\nConnection: close\r\n'
  if opts.stream then
    head = head .. 'Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n'
  elseif opts.body ~= nil then
    local b = json_encode(opts.body)
    head = head .. 'Content-Type: application/json\r\nContent-Length: ' .. #b .. '\r\n\r\n' .. b
  else
    head = head .. '\r\n'
  end

  local function write(s)
    if h.closed then return end
    pipe:write(s)
  end
  -- send writes one NDJSON frame of a streamed request body.
  function h.send(frame)
    local line = json_encode(frame) .. '\n'
    write(string.format('%x\r\n%s\r\n', #line, line))
  end
  function h.finish()
    if h.body_done then return end
    h.body_done = true
    write('0\r\n\r\n')
  end
  function h.close() done('closed') end

  pipe:connect(opts.socket or M.socket_path(), function(err)
    if err then
      done('sandboxd is not running (nothing answers on ' .. (opts.socket or M.socket_path()) .. '): ' .. err
        .. '; start it with `sandboxd` or any nook command')
      return
    end
    write(head)
    if opts.stream and opts.body ~= nil then h.send(opts.body) end
    pipe:read_start(function(rerr, chunk)
      if rerr then done('reading from sandboxd: ' .. rerr); return end
      if chunk then
        parser.feed(chunk)
      else
        if not parser.eof() then done('sandboxd closed the connection before the answer ended') end
      end
    end)
  end)
  return h
end

-- call is a plain JSON request: cb(err, body).
function M.call(method, path, body, query, cb)
  return M.request({ method = method, path = path, body = body, query = query, on_done = function(err, _, b) cb(err, b) end })
end

-- base64 decoding (exec frames carry bytes as base64), LuaJIT's bit ops.
local b64 = {}
do
  local chars = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
  for i = 1, #chars do b64[chars:byte(i)] = i - 1 end
end
local bit = require('bit')
function M.base64_decode(s)
  local out = {}
  local acc, bits = 0, 0
  for i = 1, #s do
    local v = b64[s:byte(i)]
    if v then
      acc = bit.bor(bit.lshift(acc, 6), v)
      bits = bits + 6
      if bits >= 8 then
        bits = bits - 8
        table.insert(out, string.char(bit.band(bit.rshift(acc, bits), 0xff)))
      end
    end
  end
  return table.concat(out)
end

return M
