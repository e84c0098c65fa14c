"""`specserve check`: end-to-end self-tests of a deployment (`check exact`: the exactness promise)."""
