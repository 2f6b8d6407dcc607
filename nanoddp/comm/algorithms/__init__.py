"""The bulk algorithms over send/recv (ring, halving/doubling, tree, van de Geijn, chain,
exchange) and the reductions and piece cutting they share, each readable on its own; they import
only `plan` and the transport."""
