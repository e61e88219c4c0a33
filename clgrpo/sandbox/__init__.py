"""Child processes: the sandboxed Python tool (pool, isolation, worker) and the math-verify pool's children."""
