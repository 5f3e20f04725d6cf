"""The MTP tests' negative control: a pool that stores only the target model's KV (SGLang #31600's failure)."""
from __future__ import annotations


def drop_mtp_kv(engine, first_mtp_layer: int) -> None:
    """From now on every block ``engine`` loads from its pool comes back with the MTP layers' part zeroed (cache
    layers ``first_mtp_layer`` on, i.e. ``num_hidden_layers``): what a pool of the target's KV alone hands back."""
    real_load = engine.loader.load

    def target_only(keys):
        blocks = real_load(keys)
        for blk in blocks:
            for layer in blk[first_mtp_layer:]:
                for part in layer:
                    part.zero_()
        return blocks

    engine.loader.load = target_only
