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

Why a budget, per call and across calls: job_submit_lua.c runs one call at a time (its lua_lock),
and every call waiting for it sits in an RPC thread that holds the job read lock (proc_req.c calls
validate_job_create_req under job_read_lock). A writer (the previous job's job_allocate, the
scheduler) waits for all of them, and every new reader (sinfo, squeue) waits behind that writer
(locks.c: a read lock waits while a write lock is pending). So what stalls the controller is the SUM
of the calls, and past MessageTimeout (10 s) sbatch reports a failure while the job is created
anyway (a ghost job). Hence:
  - one call never waits longer than min(timeout_s, fallback_burst_ms), but for the retry below;
  - time spent on anything but a healthy server's answer (the per-call program; a server that is
    gone, hangs, dies mid-answer or answers garbage) is drawn from a token bucket: at most
    fallback_burst_ms, refilled at fallback_ms_per_s; a call that finds too little in it takes the
    fail mode at once, without trying anything;
  - a circuit breaker: after the server failed, it is tried again at most once a second (or at once
    when vest-bridge.json is rewritten: a (re)started server writes it), within the bucket or, when
    it is empty, within PROBE_FLOOR_S; logged when it opens and closes ("vest-bridge: breaker=...");
  - a request in flight when the server dies (an I/O error, not a timeout) is retried once through
    the per-call program within what is left of timeout_s (into the bucket's debt if need be).
The state lives in this Lua state, which the plugin keeps from call to call (it reloads the script
only when its mtime changes).

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
  fallback_ms_per_s = 200,       -- the site config's [bridge] defaults (vest_slurm/site/config.py)
  fallback_burst_ms = 800,
  written = 0,
}
local FACTS_FILE = "vest-bridge.json"      -- beside this file
local TIMEOUT_BIN = "/usr/bin/timeout"     -- absolute: slurmctld's PATH is whatever it started with
local ENV_BIN = "/usr/bin/env"
local MAX_ANSWER_BYTES = 65536
local MAX_TIMEOUT_S = 9                    -- below MessageTimeout (10 s)
local RETRY_S = 1.0                        -- the breaker tries the server at most once a second
local MIN_PROGRAM_S = 0.05                 -- less than this left: not worth a Python start
-- A retry of the server while the bucket is empty still gets this long (drawn as debt): a healthy
-- server answers in a few ms (a whole sbatch: p99 35 ms, benchmarks/bench_bridge.json), so this
-- finds a restarted one, and a hung one costs at most this per retry, i.e. 100 ms a second.
local PROBE_FLOOR_S = 0.1
-- The per-call program is started only when the bucket holds what its recent runs took: a weighted
-- mean of their durations (weight 0.3 for the newest: it follows a change of load within a few runs)
-- with a quarter more for their spread. Until one has run, any positive amount will do (the first
-- run measures it); a run that was killed counts as twice the time it got.
local COST_WEIGHT, COST_MARGIN = 0.3, 1.25
local SETTABLE = { partition = true, tres_per_node = true, tres_per_job = true, tres_per_task = true }
local ERRNOS = { [2002] = true, [2072] = true }  -- ESLURM_ACCESS_DENIED, ESLURM_INVALID_GRES
local ESLURM_ACCESS_DENIED = 2002
local RECORD_LINE = "#VEST-RECORD "            -- vest's record in the batch script (slurm/accounting.py)
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
  if type(t.fallback_ms_per_s) == "number" and t.fallback_ms_per_s > 0 then
    facts.fallback_ms_per_s = math.min(t.fallback_ms_per_s, 500)
  end
  if type(t.fallback_burst_ms) == "number" and t.fallback_burst_ms > 0 then
    facts.fallback_burst_ms = math.min(t.fallback_burst_ms, (MAX_TIMEOUT_S - 1) * 1000)
  end
  if type(t.written) == "number" then facts.written = t.written end
  last_facts = facts
  return facts
end

-- ---------------------------------------------------------------- the budget across calls
local bucket = { ms = nil, t = 0, cost_ms = nil }   -- ms: what is left (nil: full at first use)
local breaker = { open = false, since = 0, next_try = 0, why = "", written = nil,
                  program = 0, failed = 0 }

local function refill(facts, now)
  local cap = facts.fallback_burst_ms
  if bucket.ms == nil then bucket.ms = cap end
  bucket.ms = math.min(cap, bucket.ms + (now - bucket.t) * facts.fallback_ms_per_s)
  bucket.t = now
end

local function spend(seconds)
  bucket.ms = bucket.ms - seconds * 1000      -- may go below zero: a debt the refill pays back
end

local function program_cost_ms(ran_s, finished)
  local ms = ran_s * 1000
  if not finished then ms = 2 * ms end
  if bucket.cost_ms == nil then bucket.cost_ms = ms
  else bucket.cost_ms = (1 - COST_WEIGHT) * bucket.cost_ms + COST_WEIGHT * ms end
end

local function program_affordable(facts)
  local need = 1
  if bucket.cost_ms then need = math.min(bucket.cost_ms * COST_MARGIN, facts.fallback_burst_ms) end
  return bucket.ms >= need
end

local function breaker_open(why, uid, now)
  if breaker.open then return end
  breaker.open, breaker.since, breaker.why = true, now, why
  breaker.program, breaker.failed = 0, 0
  log(string.format("vest-bridge: breaker=open reason=%s uid=%d budget_ms=%.0f", why, uid, bucket.ms))
end

local function breaker_close(now, how)
  if not breaker.open then return end
  log(string.format("vest-bridge: breaker=closed after_s=%.1f reason=%s was=%s program_calls=%d " ..
                    "fail_mode_calls=%d budget_ms=%.0f", now - breaker.since, how, breaker.why,
                    breaker.program, breaker.failed, bucket.ms))
  breaker.open = false
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
-- A log value from the user (the job name): percent-encoded unless plain, as the server's kv() does,
-- so that it cannot forge a field or a line.
local function kv(v)
  if type(v) ~= "string" or v == "" then return "-" end
  if #v > 200 then v = v:sub(1, 200) .. "..." end
  return (v:gsub("[^%w_%.,:/@+%-]", function(c) return string.format("%%%02X", c:byte()) end))
end

local function fail_mode(facts, why, uid, t0, via, limit_s, job)
  local ms = (socket.gettime() - t0) * 1000
  local budget = string.format("budget_ms=%.0f limit_ms=%.0f job=%s", bucket.ms or 0, (limit_s or 0) * 1000,
                               kv(job))
  if facts.fail == "closed" then
    log(string.format("vest-bridge: action=refuse reason=bridge-%s fail=closed uid=%d via=%s ms=%.1f %s",
                      why, uid, via, ms, budget))
    slurm.log_user("%s", "The job was not submitted: the GPU memory check is unavailable right now " ..
                   "(the site refuses jobs it cannot check). Please try again in a minute, or " ..
                   "contact the admins if this persists.")
    return ESLURM_ACCESS_DENIED
  end
  log(string.format("vest-bridge: action=allow reason=bridge-%s fail=open uid=%d via=%s ms=%.1f %s",
                    why, uid, via, ms, budget))
  return slurm.SUCCESS
end

local function apply(a, job_desc, via, t0)
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
  -- vest's decision for `vest audit`, in the job's AdminComment (only admins can write that field)
  -- and as a last comment line of its batch script, which accounting keeps with
  -- AccountingStoreFlags=job_script: Jobstats' epilog replaces the whole AdminComment. slurmdbd
  -- keeps one text per hash of the script as submitted (the hash is taken before this plugin), so
  -- identical scripts share the first one's line; vest audit uses it only on the GPU type it names
  if type(a.record) == "string" and #a.record <= 256 and a.record:match("^vest1:[%w_%.,:=+%-]+$") then
    job_desc.admin_comment = a.record
    local s = job_desc.script
    if type(s) == "string" and s ~= "" then
      if s:sub(-1) ~= "\n" then s = s .. "\n" end
      job_desc.script = s .. RECORD_LINE .. a.record .. "\n"
    end
  end
  if a.msg ~= "" then slurm.log_user("%s", a.msg) end
  return slurm.SUCCESS
end

-- The per-call program within the bucket and the call's deadline: (answer, err, ran).
local function fallback(facts, line, deadline, need_s, into_debt)
  local now = socket.gettime()
  local until_ = math.min(deadline, now + math.max(bucket.ms, 0) / 1000)
  if into_debt and bucket.ms > 0 then until_ = deadline end
  if until_ - now < need_s then return nil, "budget", false end
  local answer, err = ask_program(facts, line, until_)
  local ran = socket.gettime() - now
  spend(ran)
  program_cost_ms(ran, answer ~= nil)
  return answer, err, true
end

-- A '#VEST-RECORD' line the user wrote would pass for vest's record (vest audit reads the script's
-- last one): every such line is dropped from every script, whatever the bridge decides after.
local function strip_records(job_desc)
  local s = job_desc.script
  if type(s) ~= "string" or not s:find(RECORD_LINE, 1, true) then return end
  local kept = {}
  for line in (s .. (s:sub(-1) == "\n" and "" or "\n")):gmatch("([^\n]*)\n") do
    if line:sub(1, #RECORD_LINE) ~= RECORD_LINE then kept[#kept + 1] = line end
  end
  job_desc.script = table.concat(kept, "\n") .. "\n"
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local t0 = socket.gettime()
  strip_records(job_desc)
  local facts = load_facts()
  if submit_uid == 0 or member(facts.exempt_uids, submit_uid)
     or member(facts.exempt_accounts, job_desc.account) then
    log(string.format("vest-bridge: action=allow reason=exempt uid=%d via=lua", submit_uid))
    return slurm.SUCCESS
  end
  refill(facts, t0)
  if breaker.written ~= facts.written then
    -- vest-bridge.json was rewritten: a server (re)started or reloaded; try it now.
    breaker.written = facts.written
    breaker.next_try = 0
  end
  local ok, line = pcall(request_line, job_desc, submit_uid)
  if not ok then return fail_mode(facts, "encode", submit_uid, t0, "lua", 0, nil) end
  local limit = math.min(facts.timeout_s, facts.fallback_burst_ms / 1000)
  local deadline = t0 + limit
  local answer, err, via = nil, nil, "server"
  if not breaker.open or t0 >= breaker.next_try then
    if breaker.open then limit = math.min(limit, math.max(bucket.ms / 1000, PROBE_FLOOR_S)) end
    deadline = t0 + limit
    answer, err = ask_server(facts, line, deadline)
    local a, why
    if answer then a, why = parse_answer(answer) end
    local now = socket.gettime()
    if a then
      breaker_close(now, "answered")
      if a.action == "error" then
        log(a.log .. " via=server")
        return fail_mode(facts, "error", submit_uid, t0, "server", limit, job_desc.name)
      end
      return apply(a, job_desc, "server", t0)
    end
    spend(now - t0)                                  -- a failed server costs the budget
    breaker.next_try = now + RETRY_S
    breaker_open(err or why, submit_uid, now)
    if answer then                                    -- answered, but not a valid answer
      breaker.failed = breaker.failed + 1
      return fail_mode(facts, why, submit_uid, t0, "server", limit, job_desc.name)
    end
    if err == "timeout" then                          -- the call's time is spent
      breaker.failed = breaker.failed + 1
      return fail_mode(facts, err, submit_uid, t0, "server", limit, job_desc.name)
    end
    -- "connect" (nobody listens) or "io" (it died with our request in flight): once through the
    -- per-call program, within what is left of this call.
    via = (err == "io") and "program after=server-io" or "program"
    local ran
    if err == "io" then
      -- A server that died (not one that hangs) with our request: this call may take what is left
      -- of timeout_s, into debt if the bucket holds less; the debt then stops further fallbacks
      -- until the refill has paid it back, so this happens at most once per debt.
      answer, err, ran = fallback(facts, line, t0 + facts.timeout_s, MIN_PROGRAM_S, true)
    elseif program_affordable(facts) then
      answer, err, ran = fallback(facts, line, t0 + limit, MIN_PROGRAM_S)
    else
      err = "budget"
    end
  elseif program_affordable(facts) then
    via = "program"
    answer, err = fallback(facts, line, t0 + limit, MIN_PROGRAM_S)
  else
    err = "budget"
    via = "lua"
  end
  if not answer then
    breaker.failed = breaker.failed + 1
    return fail_mode(facts, err, submit_uid, t0, via, limit, job_desc.name)
  end
  local a, why = parse_answer(answer)
  if not a then
    breaker.failed = breaker.failed + 1
    return fail_mode(facts, why, submit_uid, t0, via, limit, job_desc.name)
  end
  breaker.program = breaker.program + 1
  if a.action == "error" then
    log(a.log .. " via=" .. via)
    return fail_mode(facts, "error", submit_uid, t0, via, limit, job_desc.name)
  end
  return apply(a, job_desc, via, t0)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

log("vest-bridge: job_submit.lua loaded from " .. HERE)
return slurm.SUCCESS
