"""The run profile's ``promotion:`` rule."""
