"""Model families, one package each (``llama/``, ``deepseek_v2/``): its arguments and flavors
(``args.py``), the model (``model.py``, knowing nothing of parallelism) and its parallelize step
(``parallelize.py``). ``decoder.py`` holds the skeleton and layers the families share;
``registry.py`` maps a family name to its parts (:class:`~ray_titan.models.registry.ModelSpec`)."""
