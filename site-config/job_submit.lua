--[[
job_submit.lua: vest-slurm's bridge inside slurmctld (JobSubmitPlugins=lua, beside slurm.conf).

A thin shim with no policy: every rule lives in the Python decision (vest_slurm/bridge). For each
submission it
  1. lets root and the exempt uids/accounts of the site config through untouched;
  2. sends the job's description as one JSON line over a UNIX socket to the resident decision server
     (`vest bridge serve`), with a hard total timeout;
  3. when nothing listens on the socket, runs the per-call decision program instead, with the job in
     a mode-0600 temp file on its stdin: its command line holds only admin paths, never user data;
  4. applies the answer: set partition/tres fields, or refuse with the user's message;
  5. when no valid answer comes in time, applies the site's fail mode (open: let the job through;
     closed: refuse it);
  6. writes one greppable line per decision to the slurmctld log ("vest-bridge: action=...").

Why a hard timeout: this runs while slurmctld holds its locks; a slow plugin stalls every other
submission, sinfo and the scheduler, and past MessageTimeout (10 s) sbatch reports a failure while
the job is created anyway. The timeout (default 2 s) stays far below that.

Site facts come from the site config through vest-bridge.json beside this file (written by the
server on every reload, or by `vest bridge lua-config`); the defaults below apply until it exists.
See site-config/README.md.
--]]

-- ---------------------------------------------------------------- site facts (defaults)
local DEFAULTS = {
  socket_path = "/run/vest/bridge.sock",
  timeout_s = 2.0,
  fail = "open",                 -- "open" | "closed"
  exempt_uids = { 0 },
  exempt_accounts = {},
  python = "/usr/bin/python3",
  pythonpath = "",
  site_config = "/etc/vest/site.toml",
}
local FACTS_FILE = "vest-bridge.json"      -- beside this file
local TIMEOUT_BIN = "/usr/bin/timeout"     -- absolute: slurmctld's PATH is whatever it started with
local ENV_BIN = "/usr/bin/env"
local MAX_ANSWER_BYTES = 65536
local MAX_TIMEOUT_S = 9                    -- below MessageTimeout (10 s)
local SETTABLE = { partition = true, tres_per_node = true, tres_per_job = true, tres_per_task = true }
local ERRNOS = { [2002] = true, [2072] = true }  -- ESLURM_ACCESS_DENIED, ESLURM_INVALID_GRES
local ESLURM_ACCESS_DENIED = 2002
local FIELDS = { "account", "partition", "tres_per_node", "tres_per_job", "tres_per_task",
                 "tres_per_socket", "gres", "comment", "name", "work_dir", "script",
                 "min_nodes", "num_tasks", "ntasks_per_node" }

-- ---------------------------------------------------------------- libraries
local cjson = require("cjson")
local socket = require("socket")
local unix = require("socket.unix")

local HERE = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "/etc/slurm"

local function log(line)
  -- slurm.log_* take a format string: never pass data as the format.
  slurm.log_info("%s", line)
end

-- Only plain absolute paths reach a command line (no space, quote or shell character).
local function safe_path(s)
  return type(s) == "string" and #s < 512 and s:match("^/[%w%./_%-+:]*$") ~= nil
end

local last_facts = DEFAULTS

local function load_facts()
  local f = io.open(HERE .. "/" .. FACTS_FILE, "rb")
  if not f then return last_facts end
  local text = f:read(65536)
  f:close()
  local ok, t = pcall(cjson.decode, text or "")
  if not ok or type(t) ~= "table" then return last_facts end
  local facts = {}
  for k, v in pairs(DEFAULTS) do facts[k] = v end
  if safe_path(t.socket_path) then facts.socket_path = t.socket_path end
  if type(t.timeout_s) == "number" and t.timeout_s > 0 then
    facts.timeout_s = math.min(t.timeout_s, MAX_TIMEOUT_S)
  end
  if t.fail == "open" or t.fail == "closed" then facts.fail = t.fail end
  if safe_path(t.python) then facts.python = t.python end
  if safe_path(t.site_config) then facts.site_config = t.site_config end
  if type(t.pythonpath) == "string" and (t.pythonpath == "" or safe_path(t.pythonpath)) then
    facts.pythonpath = t.pythonpath
  end
  if type(t.exempt_uids) == "table" then facts.exempt_uids = t.exempt_uids end
  if type(t.exempt_accounts) == "table" then facts.exempt_accounts = t.exempt_accounts end
  last_facts = facts
  return facts
end

local function member(list, x)
  if x == nil then return false end
  for _, v in ipairs(list) do if v == x then return true end end
  return false
end

-- ---------------------------------------------------------------- asking Python
local function request_line(job_desc, submit_uid)
  local req = { v = 1, uid = submit_uid }
  for _, k in ipairs(FIELDS) do
    local v = job_desc[k]
    if type(v) == "string" or type(v) == "number" then req[k] = v end
  end
  return cjson.encode(req) .. "\n"
end

-- (answer text or nil, "connect" | "timeout" | "io"); "connect" means nobody listens.
local function ask_server(facts, line, deadline)
  local c = (unix.stream or unix)()
  local function budget()  -- every operation gets only what is left of the one deadline
    c:settimeout(math.max(deadline - socket.gettime(), 0.001), "t")
  end
  budget()
  local ok, err = c:connect(facts.socket_path)
  if not ok then
    c:close()
    if err == "timeout" then return nil, "timeout" end
    return nil, "connect"
  end
  budget()
  local sent, serr = c:send(line)
  if not sent then c:close(); return nil, (serr == "timeout") and "timeout" or "io" end
  budget()
  local answer, rerr = c:receive("*l")
  c:close()
  if not answer then return nil, (rerr == "timeout") and "timeout" or "io" end
  return answer, nil
end

local function ask_program(facts, line, deadline)
  local left = deadline - socket.gettime()
  if left < 0.05 then return nil, "timeout" end
  if not (safe_path(facts.python) and safe_path(facts.site_config)) then return nil, "io" end
  local tmp = os.tmpname()                 -- mkstemp: a fresh name, mode 0600
  if not safe_path(tmp) then os.remove(tmp); return nil, "io" end
  local f = io.open(tmp, "wb")
  if not f then os.remove(tmp); return nil, "io" end
  f:write(line)
  f:close()
  local env = ""
  if facts.pythonpath ~= "" then env = ENV_BIN .. " PYTHONPATH=" .. facts.pythonpath .. " " end
  local cmd = string.format("%s -s KILL %.3f %s%s -m vest_slurm.bridge.decide --site-config %s < %s",
                            TIMEOUT_BIN, left, env, facts.python, facts.site_config, tmp)
  local p = io.popen(cmd, "r")
  if not p then os.remove(tmp); return nil, "io" end
  local out = p:read(MAX_ANSWER_BYTES)
  p:close()
  os.remove(tmp)
  if socket.gettime() > deadline then return nil, "timeout" end
  if not out then return nil, "io" end
  return (out:match("^([^\n]*)")), nil
end

-- A checked answer table, or nil and why.
local function parse_answer(text)
  if type(text) ~= "string" or #text > MAX_ANSWER_BYTES then return nil, "answer-size" end
  local ok, a = pcall(cjson.decode, text)
  if not ok or type(a) ~= "table" or a.v ~= 1 then return nil, "answer-garbage" end
  local act = a.action
  if act ~= "allow" and act ~= "modify" and act ~= "refuse" and act ~= "error" then
    return nil, "answer-action"
  end
  if type(a.msg) ~= "string" or type(a.log) ~= "string" or a.log:find("\n") then
    return nil, "answer-fields"
  end
  if act == "modify" then
    if type(a.set) ~= "table" then return nil, "answer-set" end
    for k, v in pairs(a.set) do
      if not SETTABLE[k] or type(v) ~= "string" or #v > 256 or not v:match("^[%w_%.,:/=+%-]+$") then
        return nil, "answer-set"
      end
    end
  end
  return a, nil
end

-- ---------------------------------------------------------------- the plugin
local function fail_mode(facts, why, uid, t0, via)
  local ms = (socket.gettime() - t0) * 1000
  if facts.fail == "closed" then
    log(string.format("vest-bridge: action=refuse reason=bridge-%s fail=closed uid=%d via=%s ms=%.1f",
                      why, uid, via, ms))
    slurm.log_user("%s", "The job was not submitted: the GPU memory check is unavailable right now " ..
                   "(the site refuses jobs it cannot check). Please try again in a minute, or " ..
                   "contact the admins if this persists.")
    return ESLURM_ACCESS_DENIED
  end
  log(string.format("vest-bridge: action=allow reason=bridge-%s fail=open uid=%d via=%s ms=%.1f",
                    why, uid, via, ms))
  return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local t0 = socket.gettime()
  local facts = load_facts()
  if submit_uid == 0 or member(facts.exempt_uids, submit_uid)
     or member(facts.exempt_accounts, job_desc.account) then
    log(string.format("vest-bridge: action=allow reason=exempt uid=%d via=lua", submit_uid))
    return slurm.SUCCESS
  end
  local deadline = t0 + facts.timeout_s
  local ok, line = pcall(request_line, job_desc, submit_uid)
  if not ok then return fail_mode(facts, "encode", submit_uid, t0, "lua") end
  local via = "server"
  local answer, err = ask_server(facts, line, deadline)
  if err == "connect" then
    via = "program"
    answer, err = ask_program(facts, line, deadline)
  end
  if not answer then return fail_mode(facts, err, submit_uid, t0, via) end
  local a, why = parse_answer(answer)
  if not a then return fail_mode(facts, why, submit_uid, t0, via) end
  if a.action == "error" then
    log(a.log .. " via=" .. via)
    return fail_mode(facts, "error", submit_uid, t0, via)
  end
  log(string.format("%s via=%s lua_ms=%.1f", a.log, via, (socket.gettime() - t0) * 1000))
  if a.action == "refuse" then
    slurm.log_user("%s", a.msg)
    local code = tonumber(a.errno)
    if code and ERRNOS[code] then return code end
    return slurm.ERROR
  end
  if a.action == "modify" then
    for k, v in pairs(a.set) do job_desc[k] = v end
  end
  if a.msg ~= "" then slurm.log_user("%s", a.msg) end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

log("vest-bridge: job_submit.lua loaded from " .. HERE)
return slurm.SUCCESS
