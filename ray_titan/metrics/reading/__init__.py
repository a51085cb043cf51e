"""Reading a finished run (or one a crash ended): in whatever process reads it, the driver's
``RunResult``, ``ray-titan report``, a test or a notebook, with no Ray and no live collector.
The steps table (``steps``), MoE statistics and memory slopes (``moe_stats``), the memory plan
a run recorded (``memory_plan``) and ``ray-titan report``'s plots and tables (``run_summary``)."""
