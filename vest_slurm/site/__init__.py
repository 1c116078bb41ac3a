"""The site's rules: site config and estimates in, a placement (partition, gres) or a refusal out.

- ``config``: ``site-config/*.toml`` loaded and validated into frozen records.
- ``placement``: where a job with these estimates goes, or why it goes nowhere (``NoFit``).
- ``advice``: what would fit instead (batch, AMP, checkpointing, 8-bit states, more GPUs).
- ``check``: ``vest check``; ``vsbatch``: the ``vsbatch`` command; ``targets``: the GPU types
  ``vest estimate`` estimates on; ``trust``: whose code a command may run.
"""
