--[[
job_submit.lua: vest-slurm's bridge inside slurmctld (JobSubmitPlugins=lua, beside slurm.conf).

A thin shim with no policy: every rule lives in the Python decision (vest_slurm/bridge). For each
submission it
  1. lets root and the exempt uids/accounts of the site config through untouched;
  2. sends the job's description as one JSON line over a UNIX socket to the resident decision server
     (`vest bridge serve`), with a hard total timeout;
  3. when the server gives no answer (nothing listens, it hangs, dies mid-answer, answers garbage,
     or the breaker below holds it off), decides by itself a job that carries vsbatch's estimate
     (or needs none), exactly as the server would, from the site's rules in vest-bridge.json ("the
     Lua's own decision" below: no process but one sha256sum); what it cannot decide that way goes,
     where nothing listens, to the per-call decision program, with the job in a mode-0600 temp file
     on its stdin: its command line holds only admin paths, never user data;
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
  - the Lua's own decision (below) is drawn from the same bucket;
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
  fallback_burst_ms = 600,
  written = 0,
}
local FACTS_FILE = "vest-bridge.json"      -- beside this file
local TIMEOUT_BIN = "/usr/bin/timeout"     -- absolute: slurmctld's PATH is whatever it started with
local ENV_BIN = "/usr/bin/env"
local MAX_ANSWER_BYTES = 65536
local MAX_FACTS_BYTES = 1048576            -- vest-bridge.json with the site's rules
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

local last_facts, last_text = DEFAULTS, nil

local function load_facts()
  local f = io.open(HERE .. "/" .. FACTS_FILE, "rb")
  if not f then return last_facts end
  local text = f:read(MAX_FACTS_BYTES)
  f:close()
  if text == last_text then return last_facts end   -- unchanged: no decoding on every call
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
  if type(t.rules) == "table" then facts.rules = t.rules end
  last_facts, last_text = facts, text
  return facts
end

-- ---------------------------------------------------------------- the budget across calls
local bucket = { ms = nil, t = 0, cost_ms = nil, local_ms = nil }   -- ms: what is left (nil: full at first use)
local breaker = { open = false, since = 0, next_try = 0, why = "", written = nil,
                  program = 0, failed = 0, lua = 0 }

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

-- The Lua's own decision costs one sha256sum start (about a millisecond on an idle machine; tens
-- of ms on a loaded one: benchmarks/bench_bridge_burst.json's lua_call_ms): drawn from the same
-- bucket and started only when the bucket holds what its recent runs took, as for the program.
local function local_cost_ms(ran_s)
  local ms = ran_s * 1000
  if bucket.local_ms == nil then bucket.local_ms = ms
  else bucket.local_ms = (1 - COST_WEIGHT) * bucket.local_ms + COST_WEIGHT * ms end
end

local function local_affordable()
  return bucket.ms > 0 and bucket.ms >= (bucket.local_ms or 0) * COST_MARGIN
end

local function program_affordable(facts)
  local need = 1
  if bucket.cost_ms then need = math.min(bucket.cost_ms * COST_MARGIN, facts.fallback_burst_ms) end
  return bucket.ms >= need
end

local function breaker_open(why, uid, now)
  if breaker.open then return end
  breaker.open, breaker.since, breaker.why = true, now, why
  breaker.program, breaker.failed, breaker.lua = 0, 0, 0
  log(string.format("vest-bridge: breaker=open reason=%s uid=%d budget_ms=%.0f", why, uid, bucket.ms))
end

local function breaker_close(now, how)
  if not breaker.open then return end
  log(string.format("vest-bridge: breaker=closed after_s=%.1f reason=%s was=%s program_calls=%d " ..
                    "lua_calls=%d fail_mode_calls=%d budget_ms=%.0f", now - breaker.since, how, breaker.why,
                    breaker.program, breaker.lua, breaker.failed, bucket.ms))
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

-- A checked answer table (from the server, the program or the Lua's own decision), or nil and why.
local function check_answer(a)
  if type(a) ~= "table" or a.v ~= 1 then return nil, "answer-garbage" end
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

local function parse_answer(text)
  if type(text) ~= "string" or #text > MAX_ANSWER_BYTES then return nil, "answer-size" end
  local ok, a = pcall(cjson.decode, text)
  if not ok then return nil, "answer-garbage" end
  return check_answer(a)
end

-- ---------------------------------------------------------------- the plugin
-- A log value from the user (the job name): percent-encoded unless plain, as the server's kv() does,
-- so that it cannot forge a field or a line.
local function kv(v)
  if type(v) ~= "string" or v == "" then return "-" end
  if #v > 200 then v = v:sub(1, 200) .. "..." end
  return (v:gsub("[^%w_%.,:/@+%-]", function(c) return string.format("%%%02X", c:byte()) end))
end

-- ---------------------------------------------------------------- the Lua's own decision
--[[
When no server answers, a job that carries vsbatch's estimate is decided here, in this Lua state,
without starting a process but sha256sum (a C program: about a millisecond on an idle machine,
tens of ms on a loaded one, so its time is drawn from the bucket too): the per-call Python program
costs a Python start-up inside the controller's lock. It is a port of vest_slurm/bridge/
decide.py with site/placement.py for the jobs it can decide exactly as they do, from the site's
rules in vest-bridge.json (luaconf.rules); its answer has the server's wire form and goes through
the same checks (parse_answer). Anything else is left to the server or the per-call program
(decide_local returns nil and why): a request or estimate that is not in the plain form vsbatch
and sbatch write (bytes outside [A-Za-z0-9_.,:/=+-] in the GPU fields, an estimate line that is not
the canonical JSON attach.encode writes), a request the Python would refuse as unreadable, #VEST
directives (bridge.allow_vest_directives), a site message it cannot render. tests/
test_bridge_lua_decide.py compares its answers with decide.py's on generated jobs and site rules.
--]]
local MiB = 1048576
local NO_VAL = 4294967294
local MAX_LINE_CHARS = 16384           -- slurm/attach.py
local MAX_ATTACH_BYTES = 1125899906842624  -- 2^50, attach.MAX_BYTES
local MAX_ATTACH_STRING = 128
local MAX_GPU_TYPES = 64
local MAX_MESSAGE_CHARS = 4000         -- protocol.MAX_MESSAGE_CHARS
local MAX_FIELD_CHARS = 65536          -- protocol.MAX_FIELD_CHARS (every field but the script)
local MAX_REQUEST_BYTES = 16777216     -- protocol.MAX_REQUEST_BYTES
local SHA256SUM = "/usr/bin/sha256sum"
local ESLURM_INVALID_GRES = 2072
local PLAIN = "^[A-Za-z0-9_.,:/=+%-]*$"   -- nothing Python's strip/split/regexes treat otherwise

local function bytes_less(a, b)          -- Python's str order (code points), not strcoll's
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local function split(s, sep)             -- Python's str.split(sep): empty pieces kept
  local out, i = {}, 1
  while true do
    local j = s:find(sep, i, true)
    if not j then out[#out + 1] = s:sub(i); return out end
    out[#out + 1] = s:sub(i, j - 1)
    i = j + #sep
  end
end

local function digits(s) return s ~= "" and s:match("^[0-9]+$") ~= nil end
-- Counts beyond this are left to Python (its integers are exact; products of these stay below 2^53)
local MAX_COUNT = 1000000

local function whole(v) return type(v) == "number" and v == math.floor(v) end

local function fmt_mib(n)                -- units.fmt_mib: f"{n / MiB:,.0f} MiB"
  local s = string.format("%.0f", n / MiB)
  local neg = s:sub(1, 1) == "-"
  if neg then s = s:sub(2) end
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  if out:sub(1, 1) == "," then out = out:sub(2) end
  return (neg and "-" or "") .. out .. " MiB"
end

local function join(list, sep) return table.concat(list, sep) end

-- Python's str.strip() on what render made: ASCII whitespace here; an end that Python would also
-- strip and Lua would not (\x1c-\x1f, non-ASCII) makes the decision the Python's.
local function py_strip(s)
  s = s:gsub("^[ \t\n\r\f\v]+", ""):gsub("[ \t\n\r\f\v]+$", "")
  local a, z = s:byte(1), s:byte(-1)
  for _, c in ipairs({ a, z }) do
    if c and ((c >= 0x1c and c <= 0x1f) or c >= 0x80) then return nil end
  end
  return s
end

local function render(rules, kind, values)  -- site.config.Messages.render
  local parts = rules.messages and rules.messages[kind]
  if type(parts) ~= "table" then return nil end
  local out = {}
  for _, p in ipairs(parts) do
    out[#out + 1] = p[1]
    if p[2] ~= "" then out[#out + 1] = values[p[2]] or "" end
  end
  return py_strip(table.concat(out))
end

-- decide.request_options + jobscript.gpu_request, or nil and why
local function tres_values(text)
  local out = {}
  if type(text) ~= "string" or text == "" then return out end
  for _, item in ipairs(split(text, ",")) do
    if item:sub(1, 5) == "gres:" then item = item:sub(6) end
    if item:sub(1, 5) == "gres/" then item = item:sub(6) end
    if item ~= "" then out[#out + 1] = item end
  end
  return out
end

local function gpu_count_value(text)
  local vals = {}
  for _, v in ipairs(tres_values(text)) do
    if v:sub(1, 4) == "gpu:" and #v > 4 then vals[#vals + 1] = v:sub(5) end
  end
  if #vals == 0 then return nil end
  return join(vals, ",")
end

local function parse_gres(text)          -- jobscript.parse_gres; nil where it raises
  local entries = {}
  if text:lower() == "" or text:lower() == "none" then return entries end
  for _, raw in ipairs(split(text, ",")) do
    local item = raw
    if item:sub(1, 5) == "gres:" then item = item:sub(6) end
    if item:sub(1, 5) == "gres/" then item = item:sub(6) end
    local f = split(item, ":")
    if f[1] == "" or #f > 3 then return nil end
    for _, x in ipairs(f) do if x == "" then return nil end end
    local name, gtype, count_text = f[1], nil, "1"
    if #f == 3 then gtype, count_text = f[2], f[3]
    elseif #f == 2 then
      if digits(f[2]) or (name ~= "gpu" and f[2]:match("^[0-9]+[KMGTPkmgtp]?$")) then count_text = f[2]
      else gtype = f[2] end
    end
    local count
    if name == "gpu" then
      if not digits(count_text) or #count_text > 7 or tonumber(count_text) > MAX_COUNT then return nil end
      count = tonumber(count_text)
    else
      count = digits(count_text) and tonumber(count_text) or 0
    end
    entries[#entries + 1] = { name = name, type = gtype, count = count, text = raw }
  end
  return entries
end

local function typed_count(text)         -- jobscript._typed_count; nil where it raises
  local gtype, total = nil, 0
  for _, part in ipairs(split(text, ",")) do
    local f = split(part, ":")
    local t, n
    if #f == 1 and digits(f[1]) and #f[1] <= 7 then t, n = nil, tonumber(f[1])
    elseif #f == 2 and f[1] ~= "" and digits(f[2]) and #f[2] <= 7 then t, n = f[1], tonumber(f[2])
    else return nil end
    if n > MAX_COUNT then return nil end
    if t ~= nil and gtype ~= nil and t ~= gtype then return nil end
    gtype = gtype or t
    total = total + n
  end
  return gtype, total
end

local function gpu_request(job)
  for _, k in ipairs({ "partition", "tres_per_node", "tres_per_job", "tres_per_task", "gres", "account" }) do
    local v = job[k]
    if v ~= nil and (type(v) ~= "string" or not v:match(PLAIN)) then return nil, "field-" .. k end
  end
  local function count_field(k)       -- protocol.parse_request: NO_VAL and 0 mean "not set"
    local v = job[k]
    if whole(v) and v > 0 and v < NO_VAL then return v end
    return nil
  end
  for _, k in ipairs({ "min_nodes", "num_tasks", "ntasks_per_node" }) do
    local n = count_field(k)
    if n and n > MAX_COUNT then return nil, "count-" .. k end
  end
  local nodes = count_field("min_nodes") or 1
  local ntasks = count_field("num_tasks")
  local ntpn = count_field("ntasks_per_node")
  local tasks_per_node = ntpn or (ntasks and math.ceil(ntasks / nodes) or 1)
  local tasks_total = ntasks or (ntpn and ntpn * nodes or nodes)
  local asks, other, gpus_per_task = {}, {}, nil
  local per_node_vals = tres_values(job.tres_per_node)
  if #per_node_vals == 0 then per_node_vals = tres_values(job.gres) end
  if #per_node_vals > 0 then
    local entries = parse_gres(join(per_node_vals, ","))
    if not entries then return nil, "gres" end
    local gtype, ntypes, per_node, ngpu = nil, 0, 0, 0
    for _, e in ipairs(entries) do
      if e.name == "gpu" then
        ngpu = ngpu + 1
        per_node = per_node + e.count
        if e.type and e.type ~= gtype then
          if gtype then return nil, "gres-types" end
          gtype = e.type
        end
      else
        other[#other + 1] = e.text
      end
    end
    if ngpu > 0 then asks[#asks + 1] = { "gres", gtype, per_node, per_node * nodes } end
  end
  local v = gpu_count_value(job.tres_per_job)
  if v then
    local t, total = typed_count(v)
    if not total then return nil, "gpus" end
    asks[#asks + 1] = { "gpus", t, math.ceil(total / nodes), total }
  end
  v = gpu_count_value(job.tres_per_task)
  if v then
    local t, n = typed_count(v)
    if not n then return nil, "gpus-per-task" end
    gpus_per_task = n
    asks[#asks + 1] = { "gpus-per-task", t, n * tasks_per_node, n * tasks_total }
  end
  local kept = {}
  for _, a in ipairs(asks) do if a[4] > 0 then kept[#kept + 1] = a end end
  local r = { nodes = nodes, other = other, source = nil, gpu_type = nil, per_node = 0, total = 0 }
  if #kept == 0 then return r end
  local t0, n0 = nil, kept[1][3]
  for _, a in ipairs(kept) do
    if a[2] then
      if t0 and a[2] ~= t0 then return nil, "gpu-options-disagree" end
      t0 = a[2]
    end
    if a[3] ~= n0 then return nil, "gpu-options-disagree" end
  end
  r.source, r.gpu_type, r.per_node, r.total, r.gpus_per_task = kept[1][1], t0, kept[1][3], kept[1][4], gpus_per_task
  return r
end

local function gres_string(r, t) return string.format("gpu:%s:%d", t, math.max(r.per_node, 1)) end

local function overrides_for(r, t)       -- GpuRequest.overrides_for
  if r.source == "gpus" then return { { "gpus", string.format("%s:%d", t, r.total) } } end
  if r.source == "gpus-per-task" then return { { "gpus-per-task", string.format("%s:%d", t, r.gpus_per_task) } } end
  local g = { gres_string(r, t) }
  for _, o in ipairs(r.other) do g[#g + 1] = o end
  return { { "gres", join(g, ",") } }
end

-- slurm/attach.py: the estimate line, checked as _check does, and only in the canonical form
-- encode() writes (anything else: nil, so that the Python decides it).
local B64 = {}
do
  local a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
  for i = 1, #a do B64[a:byte(i)] = i - 1 end
end

local function b64url_decode(s)
  if #s % 4 == 1 then return nil end
  local out, acc, bits = {}, 0, 0
  for i = 1, #s do
    local v = B64[s:byte(i)]
    if not v then return nil end
    acc = acc * 64 + v
    bits = bits + 6
    if bits >= 8 then
      bits = bits - 8
      local p = 2 ^ bits
      out[#out + 1] = string.char(math.floor(acc / p))
      acc = acc % p
    end
  end
  return table.concat(out)
end

local function canon_str(v)
  if type(v) ~= "string" or #v > MAX_ATTACH_STRING or not v:match("^[ !#-Z%[%]^-~]*$") then return nil end
  return '"' .. v .. '"'
end

local function canon_int(v, minimum)
  if not whole(v) or v < minimum or v > MAX_ATTACH_BYTES then return nil end
  return string.format("%d", v)
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do
    if type(k) ~= "string" then return nil end
    ks[#ks + 1] = k
  end
  table.sort(ks, bytes_less)
  return ks
end

local function canonical_estimate(obj)  -- (estimate, canonical JSON text) or nil
  local want = { batch_size = 1, created = 1, gpus = 1, num_gpus = 1, script_sha256 = 1,
                 tool_version = 1, version = 1 }
  local n = 0
  for k in pairs(obj) do
    if not want[k] then return nil end
    n = n + 1
  end
  if n ~= 7 or obj.version ~= 1 or type(obj.gpus) ~= "table" then return nil end
  local sha = canon_str(obj.script_sha256)
  if not sha or not obj.script_sha256:match("^" .. string.rep("[0-9a-f]", 64) .. "$") then return nil end
  local names = sorted_keys(obj.gpus)
  if not names or #names < 1 or #names > MAX_GPU_TYPES then return nil end
  local gparts, gpus = {}, {}
  for _, name in ipairs(names) do
    local g = obj.gpus[name]
    if #name > MAX_ATTACH_STRING or not name:match("^[A-Za-z0-9_.%-]+$") or type(g) ~= "table" then return nil end
    local c = 0
    for k in pairs(g) do
      if k ~= "peak_bytes" and k ~= "profile" and k ~= "required_bytes" then return nil end
      c = c + 1
    end
    if c ~= 3 then return nil end
    local pk, pr, rq = canon_int(g.peak_bytes, 0), canon_str(g.profile), canon_int(g.required_bytes, 0)
    if not (pk and pr and rq) then return nil end
    gparts[#gparts + 1] = string.format('"%s":{"peak_bytes":%s,"profile":%s,"required_bytes":%s}', name, pk, pr, rq)
    gpus[name] = { profile = g.profile, required = g.required_bytes, peak = g.peak_bytes }
  end
  local batch
  if obj.batch_size == cjson.null then batch = "null" else batch = canon_int(obj.batch_size, 1) end
  local ng, tv, cr = canon_int(obj.num_gpus, 1), canon_str(obj.tool_version), canon_str(obj.created)
  if not (batch and ng and tv and cr) then return nil end
  local text = string.format('{"batch_size":%s,"created":%s,"gpus":{%s},"num_gpus":%s,"script_sha256":%s,' ..
                             '"tool_version":%s,"version":1}', batch, cr, join(gparts, ","), ng, sha, tv)
  return { gpus = gpus, num_gpus = obj.num_gpus, sha = obj.script_sha256 }, text
end

local function sha256_hex(data)
  local tmp = os.tmpname()
  if not safe_path(tmp) then os.remove(tmp); return nil end
  local f = io.open(tmp, "wb")
  if not f then os.remove(tmp); return nil end
  f:write(data)
  f:close()
  local p = io.popen(SHA256SUM .. " " .. tmp, "r")
  local out = p and p:read(200)
  if p then p:close() end
  os.remove(tmp)
  return out and out:match("^([0-9a-f]+)")
end

-- (nil: no estimate line | estimate) or (false, why): detach() as the Python does it
local function detach(script)
  if type(script) ~= "string" then return nil end
  local first = script:find("\n", 1, true)
  if not first or script:sub(first + 1, first + #"#VEST-ESTIMATE") ~= "#VEST-ESTIMATE" then return nil end
  local stop = script:find("\n", first + 1, true)
  local original, line
  if stop then
    original, line = script:sub(1, first) .. script:sub(stop + 1), script:sub(first + 1, stop - 1)
  else
    original, line = script:sub(1, first - 1), script:sub(first + 1)
  end
  if #line > MAX_LINE_CHARS then return false, "estimate-line" end
  local data = line:match("^#VEST%-ESTIMATE v1 ([A-Za-z0-9_%-]+)$")
  if not data then return false, "estimate-line" end
  local raw = b64url_decode(data)
  if not raw then return false, "estimate-base64" end
  local ok, obj = pcall(cjson.decode, raw)
  if not ok or type(obj) ~= "table" then return false, "estimate-json" end
  local est, text = canonical_estimate(obj)
  if not est or text ~= raw then return false, "estimate-not-canonical" end
  local h = sha256_hex(original)
  if not h then return false, "sha256sum" end
  if h ~= est.sha then return false, "estimate-hash" end
  return est
end

-- decide._Log: the admin line, in the server's format (via=lua is added by apply)
local function admin_line(action, reason, uid, user, job, more)
  local fields = { { "action", action }, { "reason", reason }, { "uid", tostring(uid) }, { "user", user },
                   { "account", job.account }, { "job", job.name }, { "partition", job.partition },
                   { "tres_per_node", job.tres_per_node }, { "tres_per_job", job.tres_per_job } }
  for _, kvp in ipairs(more or {}) do fields[#fields + 1] = kvp end
  local out = {}
  for _, f in ipairs(fields) do out[#out + 1] = f[1] .. "=" .. kv(f[2]) end
  return "vest-bridge: " .. join(out, " ")
end

local function answer(action, reason, msg, log, extra)
  if #msg > MAX_MESSAGE_CHARS then return nil, "message-length" end
  local a = { v = 1, action = action, reason = reason, set = {}, msg = msg, log = log, errno = 0 }
  for k, v in pairs(extra or {}) do a[k] = v end
  return a
end

-- decide._unknown
local function unknown(rules, user, uid, job, reason, note)
  local pol = rules.unknown_jobs
  local text = render(rules, "unknown_job", { user = user or "" })
  if text == nil then return nil, "message-unknown_job" end
  local why = string.format("This GPU job has no usable memory estimate (%s).", (note ~= "" and note) or reason)
  if pol == "refuse" then
    return answer("refuse", reason, why .. " It was not submitted. " .. text,
                  admin_line("refuse", reason, uid, user, job, { { "unknown_jobs", "refuse" } }),
                  { errno = ESLURM_ACCESS_DENIED })
  elseif pol == "warn" then
    return answer("allow", reason, why .. " " .. text,
                  admin_line("allow", reason, uid, user, job, { { "unknown_jobs", "warn" } }))
  elseif pol == "allow" then
    return answer("allow", reason, "", admin_line("allow", reason, uid, user, job, { { "unknown_jobs", "allow" } }))
  end
  return nil, "unknown-jobs-policy"
end

-- site/placement.place for a job that is not exempt (decide answered exempt users before)
local function needed_bytes(rules, peak)
  return math.ceil(peak * (1 + rules.headroom_percent / 100)) + rules.headroom_bytes
end

local function place(rules, estimates, r, partitions, user)
  local site_gpu, site_part = {}, {}
  for _, g in ipairs(rules.gpus) do if not site_gpu[g.name] then site_gpu[g.name] = g end end
  for _, p in ipairs(rules.partitions) do if not site_part[p.name] then site_part[p.name] = p end end
  local per_node, total = math.max(r.per_node, 1), math.max(r.total, 1)
  local cands = {}
  for _, part in ipairs(rules.partitions) do
    for _, t in ipairs(part.gpu_types) do
      local est, gpu = estimates[t], site_gpu[t]
      if est and gpu then
        local ok = per_node <= part.gpus_per_node
                   and (part.max_gpus_per_job == cjson.null or total <= part.max_gpus_per_job)
                   and (part.nodes == cjson.null or math.max(r.nodes, 1) <= part.nodes)
        local cost = part.cost
        if cost == cjson.null then cost = gpu.cost end
        if cost == cjson.null then cost = nil end
        local c = { partition = part.name, gpu_type = t, capacity = gpu.capacity_bytes, cost = cost,
                    needed = needed_bytes(rules, math.max(est.peak, est.required)), gpus_ok = ok,
                    order = #cands + 1 }
        c.fits = c.needed <= c.capacity and ok
        c.shortfall = math.max(0, c.needed - c.capacity)
        cands[#cands + 1] = c
      end
    end
  end
  local pset = {}
  for _, p in ipairs(partitions) do pset[p] = true end
  local constrained = #partitions > 0 or r.gpu_type ~= nil
  local chosen = {}
  for _, c in ipairs(cands) do
    if (#partitions == 0 or pset[c.partition]) and (r.gpu_type == nil or c.gpu_type == r.gpu_type) then
      chosen[#chosen + 1] = c
    end
  end
  local function any(list, key) for _, c in ipairs(list) do if c[key] then return true end end return false end
  local function filter(list, key)
    local out = {}
    for _, c in ipairs(list) do if c[key] then out[#out + 1] = c end end
    return out
  end
  local function choice_text()
    local parts = {}
    if #partitions > 0 then parts[#parts + 1] = "partition " .. join(partitions, ",") end
    if r.gpu_type then parts[#parts + 1] = "GPU type " .. r.gpu_type end
    if #parts == 0 then return "any GPU" end
    return join(parts, ", ")
  end
  local function names(list, key) local o = {} for _, x in ipairs(list) do o[#o + 1] = x[key] end return o end
  local function shapes()
    local o = {}
    for _, p in ipairs(rules.partitions) do
      local s = string.format("%s: %d per node", p.name, p.gpus_per_node)
      if p.nodes ~= cjson.null then s = s .. string.format(", %d node%s", p.nodes, p.nodes > 1 and "s" or "") end
      if p.max_gpus_per_job ~= cjson.null then s = s .. string.format(", at most %d a job", p.max_gpus_per_job) end
      o[#o + 1] = s
    end
    return join(o, "; ")
  end
  local policy = rules.on_user_choice_too_small
  -- RULES, in order; the first refusal wins
  local refusal, text
  if #cands == 0 then
    refusal = "no-estimate"
    text = string.format("there is no memory estimate for any GPU type of this site (%s).", join(names(rules.gpus, "name"), ", "))
  end
  if not refusal then
    local unknown_parts = {}
    for _, p in ipairs(partitions) do if not site_part[p] then unknown_parts[#unknown_parts + 1] = p end end
    if #unknown_parts > 0 then
      refusal = "unknown-partition"
      text = string.format("partition %s is not a GPU partition of this site (GPU partitions: %s).",
                           join(unknown_parts, ", "), join(names(rules.partitions, "name"), ", "))
    end
  end
  if not refusal and r.gpu_type then
    local t = r.gpu_type
    if not site_gpu[t] then
      refusal = "unknown-gpu-type"
      text = string.format("GPU type '%s' does not exist here (GPU types: %s).", t, join(names(rules.gpus, "name"), ", "))
    elseif #partitions > 0 then
      local has = false
      for _, p in ipairs(partitions) do
        for _, g in ipairs(site_part[p].gpu_types) do if g == t then has = true end end
      end
      if not has then
        local with = {}
        for _, p in ipairs(rules.partitions) do
          for _, g in ipairs(p.gpu_types) do if g == t then with[#with + 1] = p.name; break end end
        end
        refusal = "unknown-gpu-type"
        text = string.format("partition %s has no %s GPUs (%s is in: %s).", join(partitions, ", "), t, t,
                             #with > 0 and join(with, ", ") or "no partition")
      end
    end
  end
  if not refusal then
    local pool = (constrained and policy == "refuse") and chosen or cands
    if #pool > 0 and not any(pool, "gpus_ok") then
      refusal = "too-many-gpus"
      text = string.format("the job asks for %d GPU(s) per node, %d in all%s, more than any partition allows (%s).",
                           math.max(r.per_node, 1), math.max(r.total, 1),
                           r.nodes > 1 and string.format(" on %d nodes", r.nodes) or "", shapes())
    end
  end
  if not refusal and not any(cands, "fits") then
    refusal, text = "no-fit", "the job does not fit on any GPU of this site."
  end
  if not refusal and constrained and policy == "refuse" and not any(chosen, "fits") then
    refusal = "user-choice-too-small"
    text = string.format("the job does not fit on the GPUs you asked for (%s).", choice_text())
  end
  local function min_by(list, less)
    local best
    for _, c in ipairs(list) do if best == nil or less(c, best) then best = c end end
    return best
  end
  local function max_by(list, greater)
    local best
    for _, c in ipairs(list) do if best == nil or greater(c, best) then best = c end end
    return best
  end
  if refusal then
    local pool = filter(cands, "gpus_ok")
    if #pool == 0 then pool = cands end
    if refusal == "user-choice-too-small" then
      local p2 = filter(chosen, "gpus_ok")
      if #p2 == 0 then p2 = chosen end
      if #p2 > 0 then pool = p2 end
    end
    local closest = min_by(pool, function(a, b)
      if a.shortfall ~= b.shortfall then return a.shortfall < b.shortfall end
      return a.capacity > b.capacity
    end)
    local largest = max_by(cands, function(a, b) return a.capacity > b.capacity end)
    local lines = { "The job was refused: " .. text }
    if closest then
      local est = estimates[closest.gpu_type]
      lines[#lines + 1] = string.format("It needs %s per GPU with the site's headroom (estimated peak %s).",
                                        fmt_mib(closest.needed), fmt_mib(math.max(est.peak, est.required)))
    end
    if largest then
      lines[#lines + 1] = string.format("The largest GPU here is %s with %s", largest.gpu_type, fmt_mib(largest.capacity)) ..
                          (largest.shortfall > 0 and string.format(": %s short.", fmt_mib(largest.shortfall)) or ".")
    end
    if closest and (refusal == "no-fit" or refusal == "user-choice-too-small" or refusal == "too-many-gpus") then
      lines[#lines + 1] = string.format("Closest: partition %s, %s.", closest.partition, gres_string(r, closest.gpu_type))
    end
    local site_text = render(rules, "refuse", { user = user or "", reason = refusal })
    if site_text == nil then return nil, "message-refuse" end
    if site_text ~= "" then lines[#lines + 1] = site_text end
    return { refuse = true, reason = refusal, msg = join(lines, "\n"), closest = closest, largest = largest }
  end
  local by_cost = rules.selection == "cost"
  local function better(a, b)            -- placement._best's key, smaller first
    local ka, kb
    if by_cost then
      ka = { a.cost or math.huge, a.capacity, a.order }
      kb = { b.cost or math.huge, b.capacity, b.order }
    else
      ka = { a.capacity, a.cost or 0, a.order }
      kb = { b.capacity, b.cost or 0, b.order }
    end
    for i = 1, 3 do if ka[i] ~= kb[i] then return ka[i] < kb[i] end end
    return false
  end
  local function larger(a, b)            -- placement._largest's key, larger first
    local ga, gb = a.gpus_ok and 1 or 0, b.gpus_ok and 1 or 0
    if ga ~= gb then return ga > gb end
    return (a.capacity - a.needed) > (b.capacity - b.needed)
  end
  local fitting = filter(cands, "fits")
  local reasons, warnings = {}, {}
  local best, changed
  if constrained and #chosen > 0 then
    local good = filter(chosen, "fits")
    if #good > 0 then
      best = min_by(good, better)
      changed = #good < #chosen
      if not changed then reasons[#reasons + 1] = string.format("your choice (%s) fits", choice_text())
      else reasons[#reasons + 1] = string.format("narrowed your choice (%s) to %s %s, where it fits",
                                                 choice_text(), best.partition, best.gpu_type) end
    elseif policy == "reroute" and #fitting > 0 then
      best = min_by(fitting, better)
      changed = true
      reasons[#reasons + 1] = string.format("rerouted: %s is too small for the job", choice_text())
      local w = render(rules, "reroute", { user = user or "", partition = best.partition,
                                           gres = gres_string(r, best.gpu_type), requested = choice_text() })
      if w == nil then return nil, "message-reroute" end
      warnings[#warnings + 1] = w
    else
      best = max_by(chosen, larger)
      changed = false
      reasons[#reasons + 1] = string.format("kept your choice (%s) although it may not fit", choice_text())
      warnings[#warnings + 1] = string.format("needs %s per GPU with headroom, %s has %s", fmt_mib(best.needed),
                                              best.gpu_type, fmt_mib(best.capacity))
      local w = render(rules, "warn", { user = user or "", partition = best.partition,
                                        gres = gres_string(r, best.gpu_type) })
      if w == nil then return nil, "message-warn" end
      warnings[#warnings + 1] = w
    end
  else
    if #fitting == 0 then return nil, "nothing-fits" end   -- only for exempt users, answered before
    best = min_by(fitting, better)
    changed = true
    reasons[#reasons + 1] = string.format("%s GPU that fits: %s in partition %s", by_cost and "cheapest" or "smallest",
                                          best.gpu_type, best.partition)
  end
  if r.total <= 0 then changed = true end
  local overrides = {}
  if changed then
    overrides[1] = { "partition", best.partition }
    for _, o in ipairs(overrides_for(r, best.gpu_type)) do overrides[#overrides + 1] = o end
  end
  return { refuse = false, best = best, changed = changed, reasons = reasons, warnings = warnings,
           overrides = overrides, gres = gres_string(r, best.gpu_type) }
end

local function fields_for(overrides, job)   -- decide._fields_for
  local pre = "gres:"
  for _, k in ipairs({ "tres_per_node", "tres_per_job", "tres_per_task" }) do
    if type(job[k]) == "string" and job[k]:sub(1, 5) == "gres/" then pre = "gres/" end
  end
  local out = {}
  for _, o in ipairs(overrides) do
    local name, value = o[1], o[2]
    if name == "partition" then out.partition = value
    elseif name == "gres" then
      local e = {}
      for _, x in ipairs(split(value, ",")) do e[#e + 1] = pre .. x end
      out.tres_per_node = join(e, ",")
    elseif name == "gpus" then out.tres_per_job = pre .. "gpu:" .. value
    elseif name == "gpus-per-task" then out.tres_per_task = pre .. "gpu:" .. value end
  end
  for _, v in pairs(out) do
    if #v < 1 or #v > 256 or not v:match("^[A-Za-z0-9_.,:/=+%-]+$") then return nil end
  end
  return out
end

-- The whole decision (decide._decide) for one job, or nil and why the Lua leaves it to Python.
local function decide_local(facts, job, uid)
  local rules = facts.rules
  if type(rules) ~= "table" or type(rules.gpus) ~= "table" or type(rules.partitions) ~= "table" then
    return nil, "no-rules"
  end
  -- what protocol.parse_request refuses (an "error" answer) is Python's to say
  for _, k in ipairs(FIELDS) do
    local v = job[k]
    if k ~= "script" and type(v) == "string" and #v > MAX_FIELD_CHARS then return nil, "field-size-" .. k end
  end
  local ok, line = pcall(request_line, job, uid)       -- the request the server would have read
  if not ok or #line >= MAX_REQUEST_BYTES then return nil, "request-size" end
  local user = job.user_name
  if type(user) ~= "string" then user = nil end
  if uid == 0 or (user and member(rules.exempt_users or {}, user)) or member(facts.exempt_accounts, job.account) then
    return answer("allow", "exempt", "", admin_line("allow", "exempt", uid, user, job))
  end
  local r, why = gpu_request(job)
  if not r then return nil, "request-" .. why end
  local script = job.script
  if script ~= nil and type(script) ~= "string" then return nil, "script" end
  local est, bad = detach(script)
  if est == false then return nil, bad end
  if r.total <= 0 and est == nil then
    return answer("allow", "no-gpu", "", admin_line("allow", "no-gpu", uid, user, job))
  end
  local source = "attached"
  local estimates = {}
  if est then
    if r.total > 0 and est.num_gpus ~= r.total then
      return unknown(rules, user, uid, job, "estimate-gpu-count",
                     string.format("the estimate is for %d GPU(s), the job asks for %d", est.num_gpus, r.total))
    end
    local n = 0
    for _, g in ipairs(rules.gpus) do
      local e = est.gpus[g.name]
      if e and e.profile == g.profile and not estimates[g.name] then
        estimates[g.name] = { peak = e.peak, required = e.required }
        n = n + 1
      end
    end
    if n == 0 then
      return unknown(rules, user, uid, job, "estimate-no-site-gpu",
                     "the estimate names none of this site's GPU types and profiles")
    end
  else
    if script == nil then return unknown(rules, user, uid, job, "no-script", "") end
    if rules.allow_vest_directives ~= false then return nil, "directives" end
    return unknown(rules, user, uid, job, "no-estimate", "")
  end
  local partitions = {}
  for _, p in ipairs(split(job.partition or "", ",")) do if p ~= "" then partitions[#partitions + 1] = p end end
  local res, perr = place(rules, estimates, r, partitions, user)
  if not res then return nil, perr end
  if res.refuse then
    return answer("refuse", res.reason, res.msg,
                  admin_line("refuse", res.reason, uid, user, job,
                             { { "source", source }, { "need_mib", res.closest and string.format("%d", math.floor(res.closest.needed / MiB)) },
                               { "largest", res.largest and res.largest.gpu_type } }),
                  { errno = ESLURM_INVALID_GRES })
  end
  local best = res.best
  local g
  for _, x in ipairs(rules.gpus) do if x.name == best.gpu_type then g = x; break end end
  local e = estimates[best.gpu_type]
  local need = math.max(e.peak, e.required)
  local record = string.format("vest1:g=%s,n=%d,q=%d,f=%d,fs=%s", best.gpu_type, math.ceil(need / MiB),
                               math.ceil(needed_bytes(rules, need) / MiB), g.floor_mib, g.floor)
  local msg = join(res.warnings, "\n")
  if not res.changed then
    return answer("allow", "fits", msg, admin_line("allow", "fits", uid, user, job,
                                                   { { "source", source }, { "gpu", best.gpu_type } }),
                  { record = record })
  end
  local set = fields_for(res.overrides, job)
  if not set then return nil, "unsafe-value" end
  local reason = ((job.partition or "") ~= "" or r.gpu_type) and "rerouted" or "placed"
  if msg == "" then
    msg = string.format("vest: job placed on partition %s (%s): %s.", best.partition, res.gres, res.reasons[1])
  end
  return answer("modify", reason, msg, admin_line("modify", reason, uid, user, job,
                                                  { { "source", source }, { "to_partition", best.partition },
                                                    { "to_gres", res.gres } }),
                { set = set, record = record })
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

-- The Lua's own decision, its time charged to the bucket (it holds the per-call program off, which
-- costs a hundred times more); a Lua error in it is a bug of ours, logged, and leaves the job to Python.
local function try_local(facts, job_desc, uid)
  if not local_affordable() then return nil, "budget" end
  local t = socket.gettime()
  local ok, a, why = pcall(decide_local, facts, job_desc, uid)
  local ran = socket.gettime() - t
  spend(ran)
  local_cost_ms(ran)
  if not ok then
    log("vest-bridge: action=lua-decide-error detail=" .. kv(tostring(a)))
    return nil, "lua-error"
  end
  if not a then return nil, why end
  return check_answer(a)
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
  local server_err = nil
  if not breaker.open or t0 >= breaker.next_try then
    -- A retry of a failed server gets what the bucket holds, at least PROBE_FLOOR_S. Not less: on
    -- a loaded machine a healthy server takes longer than that, and a breaker that keeps it cut
    -- off leaves every job to the Lua's own decision, which costs the bucket too (measured:
    -- benchmarks/README.md, "The Lua's own decision").
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
    server_err = err or why
    breaker_open(server_err, submit_uid, now)
  end
  -- No answer from the server (it failed now, or the breaker holds it off): the Lua decides what
  -- it can by itself, within the bucket.
  local a, lwhy = try_local(facts, job_desc, submit_uid)
  if a then
    breaker.lua = breaker.lua + 1
    return apply(a, job_desc, server_err and ("lua after=server-" .. server_err) or "lua", t0)
  end
  if server_err then
    if answer or err == "timeout" then                -- garbage, or the call's time is spent
      breaker.failed = breaker.failed + 1
      return fail_mode(facts, server_err, submit_uid, t0, "server", limit, job_desc.name)
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
  local pa, why = parse_answer(answer)
  if not pa then
    breaker.failed = breaker.failed + 1
    return fail_mode(facts, why, submit_uid, t0, via, limit, job_desc.name)
  end
  breaker.program = breaker.program + 1
  if pa.action == "error" then
    log(pa.log .. " via=" .. via)
    return fail_mode(facts, "error", submit_uid, t0, via, limit, job_desc.name)
  end
  return apply(pa, job_desc, via, t0)
end

-- For the tests (tests/lua_run.py): the Lua's own decision on a job description.
vest_bridge_internal = { decide_local = function(job_desc, uid) return decide_local(load_facts(), job_desc, uid) end }

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

log("vest-bridge: job_submit.lua loaded from " .. HERE)
return slurm.SUCCESS
