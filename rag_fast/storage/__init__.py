"""The storage layer: atomic directories and files, manifests with checksums and seals, the
rules of what an output folder may be, one writer at a time, a full disk said in one line,
ragged arrays.

Every directory we write is assembled under a temporary sibling name and swapped into place
in one step (``renameat2(RENAME_EXCHANGE)`` on Linux), so a crash, a kill or an interrupt
leaves either the old directory or the new one at the output path, never a half-written one
and never nothing. Where the exchange is unavailable the swap takes two renames; a writer
killed between them leaves the path empty for a moment, and the next open or save of that
path (:func:`recover_directory`) puts the complete directory back. Leftovers of killed writers
(siblings named ``.NAME.{tmp,new,old,trash}-PID-*`` whose PID is no longer alive) are removed
by the next save.

Every manifest lists each file's size and SHA-256; loading checks the sizes always and the
checksums unless told not to. The checksum is SHA-256 streamed in 8 MiB reads (OpenSSL via
hashlib, one core, constant memory); its measured rate, and why not BLAKE2b, are in
``docs/tuning.md`` ("Verifying files on load"). A cold cache adds the disk's read time.

The modules: ``manifests`` (sizes, SHA-256, seals, verified reads), ``swap`` (the exchange and
what killed writers left), ``disk`` (atomic files, full disks), ``folders`` (output folders and
atomic directories), ``locks`` (one writer) and ``ragged``. They import one another relatively
(and nothing else of rag_fast), so the package loads on its own from its folder, as the kill
tests load it.
"""
from __future__ import annotations

from .manifests import (check_files_entry, check_seal, content_digest, describe_files, KIND_WORDS,
                        listed_path, MANIFEST, MANIFEST_FORMATS, MAX_JSON_FILE_BYTES,
                        part_digests, read_json_file, read_manifest, reseal, reseal_command,
                        RESEAL_HINT, SEAL, sealed, sha256_file, StorageError, write_json,
                        write_manifest)
from .swap import (exchange, pid_alive, private_folder, recover_directory, remove_leftovers,
                   sibling)
from .disk import (append_line, atomic_file, atomic_write, atomic_write_bytes, check_name_length,
                   disk_errors, disk_free, fsync_dir, fsync_tree, is_no_space, no_space,
                   NoSpaceError, reserve_space, write_synced)
from .folders import (atomic_directory, check_apart, check_output_file, check_output_folder,
                      EVAL_KIND, folder_kind, new_folder_removed_on_failure, OUTPUT_MARKER, REFRESHED_KIND,
                      REFRESHED_PARTS,
                      RETRIEVAL_EVAL_KIND, RUN_KIND, TOKENIZER_KIND, unlisted_files, write_marker)
from .locks import (output_lock, OutputLockedError, shared_lock)
from .ragged import (RaggedArray, RaggedWriter)

__all__ = [
    "append_line",
    "atomic_directory",
    "atomic_file",
    "atomic_write",
    "atomic_write_bytes",
    "check_name_length",
    "check_apart",
    "check_files_entry",
    "check_output_file",
    "check_output_folder",
    "check_seal",
    "content_digest",
    "describe_files",
    "disk_errors",
    "disk_free",
    "EVAL_KIND",
    "exchange",
    "folder_kind",
    "fsync_dir",
    "fsync_tree",
    "is_no_space",
    "KIND_WORDS",
    "listed_path",
    "MANIFEST",
    "MANIFEST_FORMATS",
    "MAX_JSON_FILE_BYTES",
    "new_folder_removed_on_failure",
    "no_space",
    "NoSpaceError",
    "output_lock",
    "OUTPUT_MARKER",
    "OutputLockedError",
    "part_digests",
    "pid_alive",
    "private_folder",
    "RaggedArray",
    "RaggedWriter",
    "read_json_file",
    "read_manifest",
    "recover_directory",
    "REFRESHED_KIND",
    "REFRESHED_PARTS",
    "remove_leftovers",
    "reseal",
    "reseal_command",
    "RESEAL_HINT",
    "reserve_space",
    "RETRIEVAL_EVAL_KIND",
    "RUN_KIND",
    "SEAL",
    "sealed",
    "sha256_file",
    "shared_lock",
    "sibling",
    "StorageError",
    "TOKENIZER_KIND",
    "unlisted_files",
    "write_json",
    "write_manifest",
    "write_marker",
    "write_synced",
]
