"""Data sources and conversion to verl's parquet row schema."""
