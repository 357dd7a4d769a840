-- :checkhealth nook
local M = {}

local h = vim.health or {}
local start = h.start or h.report_start or function(s) vim.fn['health#report_start'](s) end
local ok = h.ok or h.report_ok or function(s) vim.fn['health#report_ok'](s) end
local warn = h.warn or h.report_warn or function(s, a) vim.fn['health#report_warn'](s, a or {}) end
local err = h.error or h.report_error or function(s, a) vim.fn['health#report_error'](s, a or {}) end

function M.check()
  start('nook')
  if vim.fn.has('nvim-0.7') == 1 then ok('Neovim ' .. tostring(vim.version().major) .. '.' .. tostring(vim.version().minor)) else err('Neovim 0.7 or newer is needed') end
  local http = require('nook.http')
  local path = http.socket_path()
  if vim.loop.fs_stat(path) == nil then
    err('no socket at ' .. path, { 'start sandboxd (`sandboxd`, or any `nook` command starts it)', 'or set SANDBOXD_SOCKET' })
    return
  end
  local done, answer, failure = false, nil, nil
  http.call('GET', '/v1/health', nil, nil, function(e, r) done, answer, failure = true, r, e end)
  vim.wait(5000, function() return done end, 20)
  if not done then return err('sandboxd at ' .. path .. ' did not answer within 5s') end
  if failure then return err('sandboxd at ' .. path .. ': ' .. failure) end
  ok(string.format('sandboxd answers on %s (store %s, %d sessions, %d connected)', path, answer.store or '?', answer.sessions or 0, answer.connections or 0))
  local st = require('nook')._state
  if st.connected then ok('following the event stream (statusline)') else warn('not following /v1/events yet: call require("nook").setup() or use require("nook").statusline() in your statusline') end
end

return M
