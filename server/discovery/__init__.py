"""Worker discovery: where a router learns which workers exist (etcd leases, DNS records)."""
