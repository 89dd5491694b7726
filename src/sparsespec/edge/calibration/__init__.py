"""Calibration: measure this machine and derive the ``host`` device profile of the edge simulator.

The edge simulator (:mod:`sparsespec.edge`) predicts decode speed from a device profile. For this machine the
profile is measured here, on the engine that decodes by default (the native kernels over the GGUF files' own
blocks, bfloat16 compute), at ``--threads`` threads:

- **read bandwidth** — an fp32 ``sum`` over buffers from 256 KiB to 1 GiB gives a curve; the DRAM rate is the
  plateau of the sizes at least 4× the last-level cache (L3; the two largest sizes when the reported L3 is larger
  than a quarter of the largest, as a virtual machine's may be), the SRAM rate the plateau of the sizes that fit the
  L3 but not the L2 caches;
- **matmul peak** — a square bf16 and fp32 GEMM (compute-bound) gives ``peak_flops``;
- **native weight streaming** — the native kernels' one-row matmul over layer-shaped weights of each GGUF block type
  (random blocks, the kernels' own layout), more of them than the caches hold, gives ``native_stream``: the rate in
  the file's bytes (a real model's weights come from DRAM: within a decode step its attention, cache and activations
  share the caches, so even a 96 MB model streams at this rate), and the same weights with R rows the rate at which
  each extra row of a verification pass goes through them;
- **dense weight streaming** — one-row bf16 ``F.linear`` over the same shapes, for dense weights (``--weights
  bf16``; ``int8`` / ``int4`` are priced as native Q8_0 / Q4_1 blocks): over the DRAM read rate it is
  ``dram_efficiency``, and R rows give ``extra_row_flops``;
- **KV residency** — whether a KV-sized buffer stays in the L3 while a stream of weights passes through it sets
  ``sram_kv_fraction``;
- **the attention op** — one layer of the KV arena's attention at two cache sizes, for one row and R rows, over the
  full cache and over a full budgeted (hybrid) cache, and at each KV dtype, with a large buffer read before each
  call (in a decode step the whole model streams between two visits of a layer's cache), with 6 query heads per KV
  head and with 1: the two slopes give ``attention_flops`` (the query heads' FLOPs) and ``attention_head_reads`` (the
  KV heads' own work) per path (and ``path:int8`` / ``path:int4``);
- **the engine's own costs** — a tiny random model whose weights stay in the caches, run through the engine's
  decode loop (:func:`sparsespec.generate.generate_tokens`) with few and many layers, gives the pass's fixed cost
  ``overhead_s`` (its intercept, less its sampling); two random models with native weights streaming from memory,
  one with narrow and one with wide layers, each timed beside a pass over its projections alone, give what a layer
  costs beyond its weights' bytes at the streaming rates above (so a narrow layer's small calls, slower than those
  rates, count there): a fixed part (``per_layer_overhead_s``) and a part in proportion to its streaming time
  (``stream_overhead_fraction``: the layer's other work runs in caches its weights just went through); their
  multi-row passes and their steps over a full budgeted cache give ``per_row_layer_overhead_s`` and the eviction's
  costs (``evict_layer_overhead_s``, ``evict_row_layer_overhead_s``), the attention op's own time taken out at the
  rates above; sampling over a small and a large vocabulary gives ``per_vocab_overhead_s``.

Hardware capacities (read bandwidth, GEMM peak, cache residency) are the best of several trials: a trial that lost
the CPU to another process says nothing about the hardware. The engine's own costs (weight streaming, decode steps,
verification passes, attention, sampling) are medians: the simulator predicts the sustained speed of a whole run,
and on a shared machine the typical step is slower than the best one. Run it on an idle machine all the same.

Not measured, so not modelled: dense weights' own rates (their native float rows are priced as torch's ``F.linear``
streams them), float activations (``--activations float``, the small models' default: priced as 8-bit ones),
retention's and recall's costs, and several requests sharing passes (``serve --parallel``).

The profile goes to ``$SPARSESPEC_HOME/devices/host.json`` (default ``~/.cache/sparsespec/devices/host.json``),
which ``edge.profile.load_profile("host")`` prefers over the packaged placeholder.

The modules, by job (each imports only those above it; the command, ``edge/commands.py``, imports them):

- :mod:`.settings` — how much to measure (:class:`~.settings.CalibrationSettings`, ``FULL``, ``QUICK``) and the
  shapes measured;
- :mod:`.machine` — what the machine reports about itself (CPU, caches, memory, load);
- :mod:`.probes` — what is timed: each function builds one workload and returns its seconds or rates;
- :mod:`.fits` — what is derived from the timings: plateaus, slopes, the attention rates, the engine's overheads;
- :mod:`.measure` — :func:`~.measure.calibrate`: the probes in order, their fits, one :class:`~.measure.Calibration`;
- :mod:`.host_profile` — the :class:`~sparsespec.edge.profile.DeviceProfile` a calibration makes, each figure with
  its source.
"""
