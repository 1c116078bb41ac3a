"""Which GPU types `vest estimate` estimates on: the site's, as vsbatch places jobs, or built-in profiles."""

from __future__ import annotations

import os


def site_for_estimate(path: str | None):
    """The site config `vest estimate` reads: one it was pointed to (an error if it cannot be read),
    else the default file where it exists, else None (built-in profiles)."""
    from .config import DEFAULT_PATH, ENV_VAR, load_site_config

    if path or os.environ.get(ENV_VAR) or os.path.exists(DEFAULT_PATH):
        return load_site_config(path)
    return None


def estimate_targets(gpus: list[str], site) -> dict:
    """{label: DeviceProfile} to estimate on. With a site config, a site GPU type is estimated as
    vsbatch places it (its profile, memory and calibrated floors) under its own name, and the
    default is the site's types; a built-in profile can still be named."""
    from ..errors import WorkloadError
    from ..estimate.profiles import PROFILES, get_profile

    site_types = {}
    if site is not None:
        from .advice import site_profiles

        site_types = site_profiles(site)
        if not gpus:
            return dict(site_types)
    elif not gpus:
        return dict(PROFILES)
    out = {}
    for g in gpus:
        if g in site_types:
            out[g] = site_types[g]
            continue
        try:
            p = get_profile(g)
        except WorkloadError as e:
            if not site_types:
                raise
            raise WorkloadError(f"unknown GPU type {g!r}", f"use one of the site's types ({', '.join(site_types)}) "
                                                           f"or a built-in profile: {', '.join(PROFILES)}") from e
        out[p.key] = p
    return out
