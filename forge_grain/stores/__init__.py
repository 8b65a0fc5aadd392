"""Token stores: one interface (`TokenStore`) over every format forge-grain reads in place.

| format     | module        | what it reads                                                        |
|------------|---------------|----------------------------------------------------------------------|
| `native`   | `native`      | forge-grain stores (`manifest.json`; `bin` or `arrayrecord` shards)  |
| `raw`      | `raw`         | nanoGPT `.bin`, OLMo/Dolma `.npy` memmaps, KempnerForge `.npy`       |
| `megatron` | `megatron`    | Megatron indexed datasets (`prefix.bin` + `prefix.idx`)             |
| `arrow`    | `arrow`       | Hugging Face `save_to_disk` datasets with a token-id list column     |
| `litdata`  | `litdata`     | LitData `optimize(...)` output for `TokensLoader`                   |
| `mds`      | `mds`         | MosaicML Streaming MDS shards with a token column                    |

`TokenStore.open(path)` detects the format (see `formats.detect`); `checks` holds the
validation every format shares and `identify` recognises files that are not token data.
"""

from forge_grain.stores.base import TokenStore
from forge_grain.stores.formats import FORMATS, detect

__all__ = ["FORMATS", "TokenStore", "detect"]
