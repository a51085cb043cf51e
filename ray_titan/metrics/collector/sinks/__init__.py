"""Where the collector writes assembled steps, each a :class:`~ray_titan.metrics.collector.sinks.base.Sink`
(log a step, flush, close): Parquet (``parquet``, its rows built in columns by ``step_table``),
TensorBoard (``tensorboard``) and Weights & Biases (``wandb``); ``scalars`` names the scalars
TensorBoard and W&B get. Runs in the collector actor."""
