"""site-config/job_submit.lua in the Lua 5.1 that Debian's slurmctld links (liblua5.1, with the
same lua-cjson and luasocket modules), outside the controller: the tests call its functions on job
descriptions and compare with the Python decision.

Only the ``slurm`` table the controller provides is stood in for (log_info, log_user, SUCCESS,
ERROR); the script, the interpreter and its modules are the real ones. A job description is a
plain table (the controller's is userdata read the same way: a missing field is nil).

LuaJob(dir).submit(job_desc: dict, uid) -> dict(rc=..., job=..., log=[...], user=[...]).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LUA_GLOBALSINDEX = -10002            # lua.h (5.1)

_PRELUDE = r"""
LOG, USER = {}, {}
slurm = { SUCCESS = 0, ERROR = -1,
          log_info = function(fmt, s) LOG[#LOG + 1] = string.format(fmt, s) end,
          log_user = function(fmt, s) USER[#USER + 1] = string.format(fmt, s) end }
"""

_CALL = r"""
local cjson = require("cjson")
local req = cjson.decode(VEST_IN)
LOG, USER = {}, {}
local job = req.job
for k, v in pairs(job) do if v == cjson.null then job[k] = nil end end
local rc
if req.fn == "local" then
  local a, why = vest_bridge_internal.decide_local(job, req.uid)
  VEST_OUT = cjson.encode({ answer = a or cjson.null, why = why or cjson.null, log = LOG, user = USER })
else
  rc = slurm_job_submit(job, {}, req.uid)
  VEST_OUT = cjson.encode({ rc = rc, job = job, log = LOG, user = USER })
end
"""


def liblua() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("lua5.1") or "liblua5.1.so.0"
    try:
        return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)   # its C modules (cjson, socket) link against it
    except OSError:
        return None


class LuaJob:
    """One Lua state running a copy of job_submit.lua from ``directory`` (beside its vest-bridge.json)."""

    def __init__(self, directory: Path):
        lib = liblua()
        if lib is None:
            raise RuntimeError("liblua5.1 is not installed (Debian: liblua5.1-0, a dependency of slurmctld)")
        self.lib = lib
        lib.luaL_newstate.restype = ctypes.c_void_p
        lib.luaL_openlibs.argtypes = [ctypes.c_void_p]
        lib.luaL_loadbuffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
        lib.luaL_loadfile.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.lua_pcall.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.lua_pushlstring.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.lua_setfield.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
        lib.lua_getfield.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
        lib.lua_tolstring.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        lib.lua_tolstring.restype = ctypes.c_void_p
        lib.lua_settop.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.lua_close.argtypes = [ctypes.c_void_p]
        self.L = lib.luaL_newstate()
        lib.luaL_openlibs(self.L)
        self.directory = Path(directory)
        script = self.directory / "job_submit.lua"
        if not script.exists():
            shutil.copy(REPO / "site-config" / "job_submit.lua", script)
        self._run_buffer(_PRELUDE, "prelude")
        self._check(lib.luaL_loadfile(self.L, str(script).encode()), "load job_submit.lua")
        self._check(lib.lua_pcall(self.L, 0, 0, 0), "run job_submit.lua")
        self._call = _CALL.encode()

    def _error(self) -> str:
        n = ctypes.c_size_t()
        p = self.lib.lua_tolstring(self.L, -1, ctypes.byref(n))
        text = ctypes.string_at(p, n.value).decode(errors="replace") if p else "?"
        self.lib.lua_settop(self.L, 0)
        return text

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: {self._error()}")

    def _run_buffer(self, code: str | bytes, name: str) -> None:
        data = code.encode() if isinstance(code, str) else code
        self._check(self.lib.luaL_loadbuffer(self.L, data, len(data), name.encode()), name)
        self._check(self.lib.lua_pcall(self.L, 0, 0, 0), name)

    def _invoke(self, payload: dict) -> dict:
        raw = json.dumps(payload, ensure_ascii=False).encode("utf-8", errors="surrogateescape")
        self.lib.lua_pushlstring(self.L, raw, len(raw))
        self.lib.lua_setfield(self.L, LUA_GLOBALSINDEX, b"VEST_IN")
        self._run_buffer(self._call, "call")
        self.lib.lua_getfield(self.L, LUA_GLOBALSINDEX, b"VEST_OUT")
        n = ctypes.c_size_t()
        p = self.lib.lua_tolstring(self.L, -1, ctypes.byref(n))
        out = ctypes.string_at(p, n.value)
        self.lib.lua_settop(self.L, 0)
        return json.loads(out.decode("utf-8", errors="surrogateescape"))

    def submit(self, job: dict, uid: int) -> dict:
        """slurm_job_submit(job_desc, part_list, uid): rc, the job table after, the log lines."""
        return self._invoke({"fn": "submit", "job": job, "uid": uid})

    def decide_local(self, job: dict, uid: int) -> dict:
        """The Lua's own decision: answer (as the server's wire answer) or why it defers."""
        return self._invoke({"fn": "local", "job": job, "uid": uid})

    def close(self) -> None:
        if self.L:
            self.lib.lua_close(self.L)
            self.L = None
