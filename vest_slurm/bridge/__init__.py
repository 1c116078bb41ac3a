"""The job_submit.lua bridge: the site's placement rules applied inside slurmctld to every submission.

Slurm runs ``site-config/job_submit.lua`` in the controller for every ``sbatch``/``srun``/``salloc``
while it holds its locks. The Lua is a thin shim: it sends the job's description as one JSON line
over a UNIX socket to a resident Python decision server (``vest bridge serve``), waits at most the
site's ``bridge.timeout_s``, and applies the answer (set partition/gres, or refuse with the user's
message). When the server gives no answer, the Lua decides by itself a job carrying vsbatch's
estimate, as decide.py would, from the site's rules that luaconf writes for it; what it cannot
decide that way, where no server listens, goes to the per-call decision program
(``python -m vest_slurm.bridge.decide``) with the job in a temp file, bounded by the same timeout.
When neither gives an answer in time, the site's ``bridge.fail`` (open or closed) decides.

Modules:
- ``protocol``: the request and answer records, their limits and the wire format (JSON lines).
- ``decide``: the decision, a pure function of (request, site config, user lookup) that reuses
  ``site.placement.place`` on the estimate vsbatch attached (``slurm.attach``); it never runs a
  model, except through the optional, time-budgeted directive estimator the server may hand it.
- ``directives``, ``worker``, ``sandbox``: allow-listed ``#VEST`` directives traced by one confined
  worker process (its own unprivileged user, no network, no writes, limits).
- ``server``: the resident threaded UNIX-socket server, config reload on SIGHUP or mtime.
- ``luaconf``: the site facts the Lua needs before any answer (socket, timeout, fail mode, exempt
  uids), written as JSON beside job_submit.lua.
- ``cli``: ``vest bridge serve|decide|test|lua-config|status``.
- ``testbed``: the test cluster with job_submit.lua and the decision server.

See site-config/README.md for the admin's view (install, reload, logs, trust model).
"""
