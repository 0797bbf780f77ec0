"""Quality harness: a synthetic long-context task suite and an evaluation client for any server."""
