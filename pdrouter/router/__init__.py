"""The front-door router: front doors, placement, admission, dispatch to the workers, metrics."""
