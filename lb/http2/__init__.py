"""HTTP/2 on the client side of the edge (and gRPC's view of the edge's own answers)."""
