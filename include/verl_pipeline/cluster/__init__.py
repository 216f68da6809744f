"""Ray cluster backends behind one lifecycle: provision → wait ready → address → teardown.

``base`` holds the lifecycle and the handle; each backend is a module of its own; ``registry`` looks
them up by name.
"""
