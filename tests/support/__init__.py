"""Test support: real external components (an etcd server) that tests start, break and restart on purpose."""
