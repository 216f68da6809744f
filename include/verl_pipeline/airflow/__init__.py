"""Airflow adapters (hook, trigger, operators, params) around the package's plain steps."""
