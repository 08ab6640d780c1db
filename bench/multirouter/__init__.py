"""Parts of ``bench.two_routers``: the cluster it starts (etcd, one set of workers, two routers), the
phases it runs against it and the tables it prints."""
