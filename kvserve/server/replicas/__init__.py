"""Replicas behind one server: engines in a Ray Serve deployment and the router that picks one.

`router.py` is plain Python (no Ray); `deployment.py` and `pool.py` import Ray and are imported
only when `--data-parallel-size` asks for replicas.
"""
