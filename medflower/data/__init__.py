"""Data layer: sources (synthetic, MedMNIST npz, csv manifests; synthetic-seg, segmentation folders),
client partitions, loaders."""

from .client import ClientData, load_client_data
from .roots import check_data_roots, data_roots
from .site import SiteClasses, load_site_data, site_data_spec
from .sources import describe_source, source_task
from .spec import PARTITIONS, SOURCE_KINDS, DataError, DataSpec
from .transforms import make_loader

__all__ = [
    "ClientData",
    "DataError",
    "DataSpec",
    "PARTITIONS",
    "SOURCE_KINDS",
    "SiteClasses",
    "check_data_roots",
    "data_roots",
    "describe_source",
    "load_client_data",
    "load_site_data",
    "make_loader",
    "site_data_spec",
    "source_task",
]
