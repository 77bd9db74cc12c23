"""Load generators and serving benchmarks; they talk to a running server over HTTP only."""
