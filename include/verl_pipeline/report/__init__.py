"""The run report: what a run did, in ``<run_dir>/report/`` (report.json, PNG plots, report.html).

============  ==============================================================================
module        what
============  ==============================================================================
``metrics``   the verl metric names the report reads
``build``     pure: verl's metric rows + the run's attempts → :class:`~.build.Report`
``scaling``   pure rules: scaling efficiency against the profile's earlier runs, flags + remedies
``plots``     the PNGs (matplotlib, Agg, imported lazily)
``html``      report.html, referencing the PNGs by relative name
``write``     :func:`~.write.write_report`: read a run directory, write its report (task and CLI)
============  ==============================================================================
"""
