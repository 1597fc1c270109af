"""KVConnectorFactory: the KV connectors by name, each imported only when an engine builds one.

`--kv-transfer-config` names a connector (`kv_connector`); the scheduler builds its scheduler half
and every worker its worker half. The registry holds where each half lives, a module and a class
as strings, not the classes themselves: a connector imports the interface (kv_connector.py), so an
interface that imported its connectors would close a circle, and an engine without a connector
imports none of them. A connector of one's own is one `register_connector` call, made in every
process that builds it (tensor-parallel workers are processes of their own).

In vLLM: vllm/distributed/kv_transfer/kv_connector/factory.py (KVConnectorFactory, whose
register_connector also takes a module path and a class name)."""
from __future__ import annotations

import importlib

from .config import KVTransferConfig


class KVConnectorFactory:
    # name -> (scheduler half, worker half), each (module, class); a relative module is this part's.
    # Most connectors are one class that serves both roles.
    _registry: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str,
                           worker: tuple[str, str] | None = None) -> None:
        """`name` is `class_name` of `module_path`; `worker`: (module_path, class_name) of a worker
        half that is a class of its own."""
        if name in cls._registry:
            raise ValueError(f"kv_connector {name!r} is already registered")
        cls._registry[name] = ((module_path, class_name), worker or (module_path, class_name))

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def create_connector(cls, config: KVTransferConfig, role, block_size: int, **context):
        """The `role` half (a KVConnectorRole: SCHEDULER or WORKER) of the connector `config` names.
        `context`: what the side that builds it knows (the scheduler: kv_cache_manager, worker_info;
        a worker: device, rank, tp_size, bytes_per_block)."""
        if config.kv_connector not in cls._registry:
            raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {', '.join(cls.names())}")
        module_path, class_name = cls._registry[config.kv_connector][role.value]  # SCHEDULER 0, WORKER 1
        connector_cls = getattr(importlib.import_module(module_path, __package__), class_name)
        return connector_cls(config, role, block_size, **context)


make_connector = KVConnectorFactory.create_connector

# Part 12's host tier: its scheduler half and its worker half are two classes in two modules.
KVConnectorFactory.register_connector("OffloadingConnector", ".offload_scheduler", "OffloadScheduler",
                                      worker=(".offload_worker", "OffloadWorker"))
KVConnectorFactory.register_connector("ExampleConnector", ".example_connector", "ExampleConnector")
# ExampleConnector's name before vLLM PR #30201
KVConnectorFactory.register_connector("SharedStorageConnector", ".example_connector", "ExampleConnector")
KVConnectorFactory.register_connector("NixlConnector", ".nixl_connector", "NixlConnector")
