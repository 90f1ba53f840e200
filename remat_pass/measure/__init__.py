"""The one measuring path: a rewritten step run node by node, its peak and timeline from the allocator, its gradients compared with the un-rewritten graph."""
