"""The run report: what a run did, in ``<run_dir>/report/`` (report.json, PNG plots, report.html).

The verl metric names it reads are in :mod:`verl_pipeline.trainer.metrics`.

============  ==============================================================================
module        what
============  ==============================================================================
``build``     pure: verl's metric rows + the run's attempts → :class:`~.build.Report`
``learning``  pure: did the run learn (train and validation reward, KL, entropy), in numbers and words
``gpu``       pure: each node's GPU utilisation and memory over the training window
``scaling``   pure rules: scaling efficiency against the profile's earlier runs; every flag + remedy
``plots``     the PNGs (matplotlib, Agg, imported lazily)
``html``      report.html, referencing the PNGs by relative name
``write``     :func:`~.write.write_report`: read a run directory, write its report (task and CLI)
============  ==============================================================================
"""
