"""Model families, one package each (``llama/``, ``deepseek_v2/``): its arguments and flavors
(``args.py``), the model (``model.py``, knowing nothing of parallelism), its parallelize step
(``parallelize.py``), its Hugging Face mapping (``state_dict_adapter.py``) and its costs
(``costs.py``); its ``__init__.py`` builds its :class:`~ray_titan.models.spec.ModelSpec`
(``SPEC``). ``decoder.py`` holds the skeleton and layers the families share; ``registry.py``
collects the families' specs and maps a family name to its spec.

Adding a family ``<name>`` (a Python identifier; it becomes ``model.name``):

1. A package ``ray_titan/models/<name>/`` with

   - ``args.py``: the arguments dataclass and ``FLAVORS`` (flavor name → arguments), with a tiny
     ``debug`` flavor that trains on CPU;
   - ``model.py``: the model, a subclass of :class:`~ray_titan.models.decoder.Decoder` built from
     the arguments (its blocks by :meth:`~ray_titan.models.decoder.Decoder.make_layer`), importing
     nothing of ``ray_titan.parallel``, ``trainer``, ``checkpoint`` or ``metrics``;
   - ``parallelize.py``: ``parallelize_<name>(stage, dims, meshes, cfg)``, the one place that
     applies parallelism: its tensor-parallel plan, then ``ray_titan.parallel.stack.apply_after_tp``
     (EP → AC → compile → FSDP);
   - ``state_dict_adapter.py``: a :class:`~ray_titan.models.state_dict_adapter.StateDictAdapter`
     subclass (``model_type``, ``architectures``, ``config.json`` ↔ arguments, tensor names);
   - ``costs.py``: ``flops_per_token(args, seq_len)`` and ``block_activations(args, layer, e,
     seq_len, device, routing_imbalance, ep)`` (``ray_titan.models.costs`` has the generic parts);
   - ``__init__.py``: ``SPEC = ModelSpec("<name>", model_cls, FLAVORS, parallelize_<name>,
     Adapter(), flops_per_token, block_activations)``, with ``config_args=moe_config_args,
     moe=True`` for a mixture-of-experts family (both from ``ray_titan.models.spec``).

   A family may take another's parts instead of its own files: ``qwen3`` is Llama's model,
   parallelize step and costs with its own flavors and adapter; ``deepseek_v3`` is DeepSeek-V2's
   model with its own flavors and adapter.
2. Its registration: the package name in ``FAMILIES`` (``ray_titan/models/registry.py``), which
   imports the package and collects its ``SPEC`` (named as its package).
3. What cannot import the registry, each checked against it by ``tests/unit/test_registry.py``:
   the name in ``Model.name``'s ``Literal`` (``ray_titan/config/schema.py``, in ``FAMILIES``'
   order; then regenerate ``docs/configuration.md`` with ``ray-titan config docs --output
   docs/configuration.md``); every module of the package but ``__init__`` and ``parallelize`` in
   the import-linter contract "Models know nothing of parallelism" (``pyproject.toml``); a row of
   the README's model table (name, architecture, Hugging Face ``model_type`` and aliases) and its
   named flavors in the flavor table of ``docs/huggingface.md``; its ``model_type`` in the opening paragraph of
   ``docs/huggingface.md``; its package in the layout of ``docs/design.md``.
4. Tests: a tiny random Hugging Face model of it (``hf_config`` and a seed in
   ``tests/support/hf_models.py``), which the tests that take every family read ``FAMILIES`` for
   (the ``hf_models`` fixture, ``tests/unit/test_hf.py``'s config checks,
   ``tests/unit/test_hostile_cli.py``); a test module of its own (``tests/unit/test_qwen3_moe.py``
   is one: logits, expert choices and balance loss against transformers, an import → train →
   export round trip, named flavors against their model cards' ``config.json``); a dry-run case
   of each flavor in ``benchmarks/dry_run_matrix.py`` (``tests/unit/test_benchmarks.py`` fails on
   a flavor without one)."""
