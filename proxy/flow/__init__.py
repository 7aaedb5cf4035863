"""One request's flow through the hops, and streaming."""
