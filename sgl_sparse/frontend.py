"""SGLang's frontend language with a per-request method: a ``RuntimeEndpoint`` whose every request carries
``custom_params`` choosing the method (sgl_sparse/request_methods.py), since ``sgl.gen`` has no field for it.

    import sglang as sgl
    from sgl_sparse.frontend import SparseEndpoint

    sub_agent = SparseEndpoint("http://localhost:30000", method="snapkv", config={"budget": 1024})
    state = my_program.run(question=q, backend=sub_agent)   # or sgl.set_default_backend(sub_agent)

Every request of the program (``gen``, ``select``'s scoring, prefix caching) is served by that method, in its
own prefix-tree namespace; the server must take per-request methods (``--sparse-request-methods eviction``,
the default on an eviction server).
"""

from __future__ import annotations

import json
from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_sparse.request_methods import CONFIG_KEY, METHOD_KEY


class SparseEndpoint(RuntimeEndpoint):
    def __init__(self, base_url: str, method: str | None = None, config: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if method is None and config is None:
            raise ValueError("SparseEndpoint: give a method, a config, or both (else use RuntimeEndpoint)")
        self.custom_params: dict[str, Any] = {}
        if method is not None:
            self.custom_params[METHOD_KEY] = method
        if config is not None:
            self.custom_params[CONFIG_KEY] = json.dumps(config)
        super().__init__(base_url, **kwargs)

    def _with_method(self, data: dict[str, Any]) -> None:
        sp = data.setdefault("sampling_params", {})
        sp["custom_params"] = {**(sp.get("custom_params") or {}), **self.custom_params}

    # Every request RuntimeEndpoint sends for a program's state goes through _add_images (generate, streaming,
    # select's scoring, lazy commits); cache_prefix does not.
    def _add_images(self, s: Any, data: dict[str, Any]) -> None:
        super()._add_images(s, data)
        self._with_method(data)

    def cache_prefix(self, prefix_str: str) -> None:
        data = {"text": prefix_str, "sampling_params": {"max_new_tokens": 0}}
        self._with_method(data)
        self._assert_success(self._post("/generate", data))

    def _post(self, path: str, data: dict[str, Any]) -> Any:
        from sglang.utils import http_request

        return http_request(self.base_url + path, json=data, api_key=self.api_key, verify=self.verify)
