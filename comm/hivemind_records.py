"""Signed DHT records: heartbeats, leaves and checksums that only the peer they name can write, and
the libp2p identity they are signed with.

A record of this backend is stored under the subkey ``"signed-by:<peer id>"`` and its value is
``[body, public key, signature]``: the signature (RSA-PSS, SHA-256) covers the DHT key, the subkey,
the expiration time and the body, and the public key must be the one the peer id is made of (a
libp2p peer id of an RSA identity is the multihash of its public key). So a record can be written
only by the holder of that peer's libp2p identity key, is not valid under another key or step (the
key is signed), and cannot be replayed with a later expiration.

Every peer checks the signature twice: its DHT node refuses to store or return a forged record
(``SignedRecordValidator``, installed in the DHT process, so a stranger cannot even overwrite an
honest record), and ``verify`` runs again on every record read, whatever the DHT nodes did.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile

import multihash
from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

SUBKEY_PREFIX = "signed-by:"
DOMAIN = b"distro-opt signed DHT record 1\0"  # a signature made for anything else never fits here
MAX_PUBLIC_KEY_NBYTES = 1024  # a 4096-bit RSA key in DER is 550 bytes; larger keys only cost us time
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class RecordSigner:
    """Signs this peer's records with its libp2p identity key (the key its peer id is made of)."""

    def __init__(self, private_key: rsa.RSAPrivateKey):
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def from_identity_file(cls, path: str) -> "RecordSigner":
        """The key of a libp2p identity file, as hivemind writes one (``identity_path``)."""
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"identity {path} is not an RSA key (hivemind makes RSA identities)")
        return cls(serialization.load_der_private_key(message.data, password=None))

    def sign(self, key: str, body: bytes, expiration: float) -> list:
        """The value to store under ``key`` and ``subkey_of(self.peer_id)`` until ``expiration``."""
        subkey = subkey_of(self.peer_id)
        signature = self._key.sign(_message(key_id(key), subkey, body, expiration), _PSS, hashes.SHA256())
        return [body, self.public_key, signature]


def start_dht(timeout_s: float, **options):
    """``(a DHT made with **options, its signer)``, started within ``timeout_s``. Without an ``identity_path``
    the DHT gets a fresh identity, written by hivemind into a private directory that is removed once
    its key is read. The DHT process runs in a session of its own (``hivemind_process``). A DHT
    that fails to start is shut down."""
    from .hivemind_process import OwnSessionDHT  # noqa: PLC0415 - this module's other users need no DHT class

    fresh = None
    if "identity_path" not in options:
        fresh = tempfile.mkdtemp(prefix="distro-opt-identity-")
        options["identity_path"] = os.path.join(fresh, "p2p.key")
    dht = OwnSessionDHT(start=False, **options)
    try:
        dht.run_in_background(await_ready=True, timeout=timeout_s)
        return dht, signer_of(dht)
    except BaseException:
        dht.shutdown()
        raise
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)


def signer_of(dht, peer_id: str | None = None) -> RecordSigner:
    """The signer of the peer whose DHT is ``dht``: the key of the identity file the DHT was made
    with (``DHT(identity_path=...)``); ``ValueError`` if it has none, or if that is not ``peer_id``."""
    path = getattr(dht, "kwargs", {}).get("identity_path")
    if not path:
        raise ValueError(
            "this peer cannot sign its DHT records: make its DHT with identity_path=FILE (hivemind "
            "writes a new identity there if FILE does not exist), or let the backend start its own DHT"
        )
    signer = RecordSigner.from_identity_file(path)
    if peer_id is not None and signer.peer_id != peer_id:
        raise ValueError(f"identity {path} is peer {signer.peer_id}, not the DHT's peer {peer_id}")
    return signer


def subkey_of(peer_id: str) -> str:
    return SUBKEY_PREFIX + peer_id


def key_id(key: str) -> bytes:
    """The DHT's id of ``key``: what its nodes (and so ``SignedRecordValidator``) see of it."""
    return DHTID.generate(source=key).to_bytes()


def peer_id_of(public_key_der: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key (SubjectPublicKeyInfo DER)."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def verify(key_id_bytes: bytes, subkey, value, expiration: float) -> bytes | None:
    """The body of a record signed by the peer its subkey names, or ``None`` for anything else."""
    if not isinstance(subkey, str) or not subkey.startswith(SUBKEY_PREFIX):
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(type(v) is bytes for v in value):
        return None
    body, public_key, signature = value
    if len(public_key) > MAX_PUBLIC_KEY_NBYTES or subkey[len(SUBKEY_PREFIX):] != peer_id_of(public_key):
        return None
    try:
        key = serialization.load_der_public_key(public_key)
        if not isinstance(key, rsa.RSAPublicKey):
            return None
        key.verify(signature, _message(key_id_bytes, subkey, body, expiration), _PSS, hashes.SHA256())
    except (ValueError, TypeError, exceptions.InvalidSignature, exceptions.UnsupportedAlgorithm):
        return None
    return body


def _message(key_id_bytes: bytes, subkey: str, body: bytes, expiration: float) -> bytes:
    return b"".join((DOMAIN, key_id_bytes, subkey.encode(), b"\0", struct.pack(">d", expiration), body))


class SignedRecordValidator(RecordValidatorBase):
    """A DHT record validator: a record under a ``signed-by:`` subkey must carry its peer's signature
    (other records pass untouched). It holds no key, so every instance is the same validator."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - not a subkey this backend wrote, so not ours to judge
            return True
        if not isinstance(subkey, str) or not subkey.startswith(SUBKEY_PREFIX):
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - a record under our subkey that is not even a value
            return False
        return verify(record.key, subkey, value, record.expiration_time) is not None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)  # one is enough per DHT node
