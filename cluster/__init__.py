"""Scale-out: job workers as Ray Core actors (`cluster/ray_pool.py`), imported only with --workers or
--ray-address."""
