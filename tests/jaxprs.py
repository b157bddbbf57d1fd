"""Walking a jaxpr in tests: its equations and those of every jaxpr inside them."""


def equations(jaxpr):
    """Every equation of `jaxpr` and, depth first, of the jaxprs its equations hold (jit, remat,
    loops, a cond's branches)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)
