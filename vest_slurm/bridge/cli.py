"""``vest bridge serve|decide|test|lua-config|status``: registered into the ``vest`` entry point.

Nothing here imports more than argparse until a subcommand runs, so ``vest`` stays fast.
"""

from __future__ import annotations

import json
import sys


def add_bridge_commands(sub) -> None:
    p = sub.add_parser("bridge", help="the job_submit.lua bridge (decision server, tests)",
                       description="The job_submit.lua bridge: run the decision server, or try a job script.")
    bsub = p.add_subparsers(dest="bridge_cmd", metavar="SUBCOMMAND", parser_class=type(p))

    s = bsub.add_parser("serve", help="run the resident decision server (foreground)")
    s.add_argument("--site-config", default=None, help="site config TOML (default: $VEST_SITE_CONFIG, /etc/vest/site.toml)")
    s.add_argument("--socket", default=None, help="UNIX socket (default: bridge.socket_path)")
    s.add_argument("--lua-conf", default=None, metavar="PATH",
                   help="write the Lua's site facts here on each (re)load, e.g. /etc/slurm/vest-bridge.json")
    s.add_argument("--log", default=None, help="decision log (default: bridge.log_path)")
    s.add_argument("--no-directives", action="store_true", help="never trace #VEST directives")
    s.set_defaults(func=cmd_serve)

    d = bsub.add_parser("decide", help="decide one request (JSON line on stdin; what job_submit.lua runs without a server)")
    d.add_argument("--site-config", default=None)
    d.set_defaults(func=cmd_decide)

    t = bsub.add_parser("test", help="show the bridge's decision for a job script, without submitting")
    t.add_argument("script", help="the job script (as sbatch would get it, with vsbatch's #VEST-ESTIMATE line or not)")
    t.add_argument("--user", required=True, help="the submitting user (name or uid)")
    t.add_argument("--account", default=None)
    t.add_argument("--partition", "-p", default=None, help="as sbatch --partition (default: the script's #SBATCH)")
    t.add_argument("--gres", default=None, help="as sbatch --gres (default: the script's #SBATCH)")
    t.add_argument("--gpus", "-G", default=None, help="as sbatch --gpus")
    t.add_argument("--site-config", default=None)
    t.add_argument("--json", action="store_true", help="print the answer as job_submit.lua receives it")
    t.set_defaults(func=cmd_test)

    lc = bsub.add_parser("lua-config", help="write the site facts job_submit.lua reads (vest-bridge.json)")
    lc.add_argument("output", help="e.g. /etc/slurm/vest-bridge.json (beside job_submit.lua)")
    lc.add_argument("--site-config", default=None)
    lc.add_argument("--python", default=None, help="python for the per-call fallback (default: this one)")
    lc.set_defaults(func=cmd_lua_config)

    st = bsub.add_parser("status", help="ask the running server which config it serves")
    st.add_argument("--site-config", default=None)
    st.add_argument("--socket", default=None)
    st.set_defaults(func=cmd_status)


def cmd_serve(ns) -> int:
    from .server import BridgeServer

    BridgeServer(_config_path(ns.site_config), ns.socket, ns.lua_conf, not ns.no_directives, ns.log).serve_forever()
    return 0


def cmd_decide(ns) -> int:
    from .decide import main

    return main(["--site-config", ns.site_config] if ns.site_config else [])


def cmd_test(ns) -> int:
    import os
    import pwd

    from ..errors import VestError
    from ..slurm.jobscript import option_value, read_job_script
    from ..site.config import load_site_config
    from .decide import decide
    from .directives import DirectiveEstimator
    from .protocol import JobRequest

    site = load_site_config(ns.site_config)
    if ns.user.isdigit():
        uid, name = int(ns.user), None
    else:
        try:
            uid, name = pwd.getpwnam(ns.user).pw_uid, ns.user
        except KeyError:
            uid, name = 65534, ns.user     # a user of another machine: decide by name
    job = read_job_script(ns.script)
    opts = list(job.options)
    partition = ns.partition or option_value(opts, "partition")
    gres = ns.gres or option_value(opts, "gres")
    gpus = ns.gpus or option_value(opts, "gpus")
    req = JobRequest(uid=uid, account=ns.account or option_value(opts, "account"), partition=partition,
                     tres_per_node=f"gres:{gres}" if gres else None,
                     tres_per_job=f"gres:gpu:{gpus}" if gpus else None,
                     name=option_value(opts, "job-name") or os.path.basename(ns.script),
                     comment=option_value(opts, "comment"), work_dir=os.getcwd(), script=job.text)
    directives = None
    if site.bridge.allow_vest_directives and job.vest_argv:
        from dataclasses import replace

        # As the server does it: the allow-list first (in decide), then the confined worker, as
        # bridge.directive_user. A test may take its time: two minutes, not the controller's budget.
        slow = replace(site, bridge=replace(site.bridge, timeout_s=240.0))
        directives = DirectiveEstimator(lambda: slow, lambda line: print(line, file=sys.stderr))
    try:
        d = decide(req, site, users=lambda u: name if name is not None else _user_of(u), directives=directives)
    finally:
        if directives:
            directives.close()
    if ns.json:
        sys.stdout.write(d.wire().decode())
        return 0
    print(f"decision: {d.action} ({d.reason})")
    if d.detail:
        print(f"why: {d.detail}")
    for k, v in d.set:
        print(f"  set {k} = {v}")
    if d.msg:
        print("user sees:")
        for line in d.msg.splitlines():
            print(f"  {line}")
    print(f"log: {d.log}")
    if d.action == "error":
        raise VestError(f"the bridge could not decide: {d.reason}",
                        f"job_submit.lua would apply bridge.fail = {site.bridge.fail}")
    return 0


def _user_of(uid: int):
    from .decide import passwd_user

    return passwd_user(uid)


def cmd_lua_config(ns) -> int:
    from ..site.config import load_site_config
    from .luaconf import write_lua_conf

    path = write_lua_conf(load_site_config(ns.site_config), ns.output, python=ns.python)
    print(f"wrote {path}")
    return 0


def cmd_status(ns) -> int:
    from ..site.config import load_site_config
    from .server import query_status

    sock = ns.socket or load_site_config(ns.site_config).bridge.socket_path
    try:
        print(json.dumps(query_status(sock), indent=1))
    except OSError as e:
        from ..errors import VestError

        raise VestError(f"no bridge server answers on {sock}: {e}",
                        "start it: systemctl start vest-bridge (or vest bridge serve); a server that runs but "
                        "does not listen has no site config loaded yet: its log (bridge.log_path, "
                        "journalctl -u vest-bridge) says why") from None
    return 0


def _config_path(path: str | None) -> str:
    from ..site.config import resolve_path

    return resolve_path(path)
