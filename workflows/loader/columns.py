"""Parquet columns as training reads them (light: no torch import, for the loader's decode processes)."""

from __future__ import annotations


def column_values(column):
    """A parquet column as training reads it: token id rows as a list of arrays (Ray Data writes
    them as a tensor extension type over a {data, shape} struct, or a list column), else numpy."""
    import pyarrow as pa

    arr = column.combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    if pa.types.is_struct(arr.type):
        arr = arr.flatten()[arr.type.get_field_index("data")]  # flatten() honours the slice offset
        return list(arr.to_numpy(zero_copy_only=False))
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return list(arr.to_numpy(zero_copy_only=False))
    return arr.to_numpy(zero_copy_only=False)
