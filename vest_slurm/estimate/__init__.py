"""The estimator: a workload in, its peak GPU memory per GPU type out. No GPU is touched.

Enters: a ``WorkloadSpec`` (``workload``: the options of ``vest estimate`` and ``#VEST`` lines; the
allow-list of ``allowlist`` for directives that are not the caller's to run) and the device
profiles to estimate on (``profiles``).
Leaves: a ``MemoryEstimate`` per profile (``record``: required and peak bytes), or EstimateError.

On the way: ``models`` builds the model on the meta device (``presets``: transformers configs as
data); ``tracing`` runs its training step with fake CUDA tensors (``_fakecuda``, the one module
that touches private torch APIs; ``_known``, values known without data; ``scratch``, memory CUDA
kernels allocate inside one op; ``cudnn_ws``, cuDNN's workspaces) into an ``AllocTrace``
(``trace``); ``allocator`` replays it through PyTorch's CUDA caching allocator (its options in
``allocator_config``; ``steady``, the rest of the run); ``estimator`` adds what lives outside the
allocator and says required and peak; ``report`` prints; ``tracecache`` keeps traces on disk.

Importing this package imports nothing: torch is loaded by the modules that need it (models,
tracing, estimator), never by workload, allowlist, presets, profiles or record.
"""
