"""The streaming engine: host store, stateless templates, stream schedule, the streaming trainer."""
