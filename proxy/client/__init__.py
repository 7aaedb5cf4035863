"""The proxy's HTTP client and the transports every hop travels on."""
