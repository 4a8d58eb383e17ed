"""The id tables, gfx decoding, libdrm's amdgpu.ids parser and the tolerant sysfs reader."""

from __future__ import annotations

import pytest

from app.inference.hardware.amd_gpus import (
    AMD_BY_REVISION,
    AMD_GPUS,
    APU_GFX_TARGETS,
    gfx_from_kfd_version,
    hsa_override_for,
    lookup_amd,
)
from app.inference.hardware.pci_ids import INTEL_GPUS, NVIDIA_GPUS, identify, parse_amdgpu_ids
from app.inference.hardware.runtimes import GFX_IN_FILE_NAME
from app.inference.hardware.sysfs import SysReader, parse_int


@pytest.mark.parametrize(
    "version, gfx",
    [
        (100300, "gfx1030"),
        (100302, "gfx1032"),
        (100303, "gfx1033"),
        (110000, "gfx1100"),
        (110003, "gfx1103"),
        (110501, "gfx1151"),
        (120001, "gfx1201"),
        (90010, "gfx90a"),
        (90012, "gfx90c"),
        (90402, "gfx942"),
        (0, None),
        (None, None),
        (101616, None),  # minor 16 is not one hex digit
    ],
)
def test_gfx_from_kfd_version(version, gfx):
    assert gfx_from_kfd_version(version) == gfx


@pytest.mark.parametrize(
    "gfx, override",
    [
        ("gfx1031", ("10.3.0", "gfx1030")),
        ("gfx1032", ("10.3.0", "gfx1030")),
        ("gfx1033", ("10.3.0", "gfx1030")),
        ("gfx1035", ("10.3.0", "gfx1030")),
        ("gfx1101", ("11.0.0", "gfx1100")),
        ("gfx1103", ("11.0.0", "gfx1100")),
        ("gfx1030", None),  # already the target
        ("gfx1100", None),
        ("gfx1201", None),  # RDNA4: no community override
        ("gfx906", None),
        (None, None),
    ],
)
def test_hsa_override_families(gfx, override):
    assert hsa_override_for(gfx) == override


def test_the_table_covers_rdna2_rdna3_rdna4_and_the_apus():
    gfx_of = {dev: model.gfx for dev, model in AMD_GPUS.items()}
    # RDNA2, RDNA3, RDNA4 desktop + laptop
    assert {
        "gfx1030",
        "gfx1031",
        "gfx1032",
        "gfx1034",
        "gfx1100",
        "gfx1101",
        "gfx1102",
        "gfx1200",
        "gfx1201",
    } <= set(gfx_of.values())
    apus = {
        "163f": "gfx1033",  # Steam Deck LCD
        "1435": "gfx1033",  # Steam Deck OLED
        "1681": "gfx1035",  # Rembrandt 680M
        "15bf": "gfx1103",  # Phoenix 780M
        "150e": "gfx1150",  # Strix Point 890M
        "1586": "gfx1151",  # Strix Halo 8060S
    }
    for dev, gfx in apus.items():
        assert gfx_of[dev] == gfx and AMD_GPUS[dev].kind == "integrated", dev
        assert gfx in APU_GFX_TARGETS
    for model in [*AMD_GPUS.values(), *AMD_BY_REVISION.values(), *NVIDIA_GPUS.values(), *INTEL_GPUS.values()]:
        assert model.kind in ("discrete", "integrated")
        assert model.bandwidth_gb_s is None or 40 <= model.bandwidth_gb_s <= 8000, model
    for (dev, _rev), model in AMD_BY_REVISION.items():
        assert model.gfx == AMD_GPUS[dev].gfx, dev  # a revision never changes the chip


def test_revision_specific_entries_win():
    assert lookup_amd("0x744C", "0xc8").name == "Radeon RX 7900 XTX"
    assert lookup_amd("744c", "cc").bandwidth_bytes_per_s == 800 * 10**9
    assert lookup_amd("744c", "ee").name == "Radeon RX 7900 XT / 7900 XTX / 7900 GRE"  # unknown revision
    assert lookup_amd("744c").vram_bytes == 24 << 30
    assert lookup_amd("ffff") is None


def test_nvidia_data_centre_bandwidth():
    assert NVIDIA_GPUS["2335"].name.startswith("H200")
    assert NVIDIA_GPUS["2335"].bandwidth_bytes_per_s == 4_800 * 10**9
    assert NVIDIA_GPUS["2330"].bandwidth_bytes_per_s == 3_350 * 10**9


AMDGPU_IDS = """# List of AMDGPU IDs
#
# Syntax:
# device_id,\trevision_id,\tproduct_name        <-- single tab after comma

1.0.0
1435,\tAE,\tAMD Custom GPU 0932
73FF,\tC7,\tAMD Radeon RX 6600
73FF,\tC1,\tAMD Radeon RX 6600 XT
ABCD,\t00,\tAMD Radeon Future, With Comma
garbage line
"""


def test_parse_amdgpu_ids():
    ids = parse_amdgpu_ids(AMDGPU_IDS)
    assert ids[("73ff", "c7")] == "AMD Radeon RX 6600"
    assert ids[("abcd", "00")] == "AMD Radeon Future, With Comma"
    assert ("1.0.0", "") not in ids and len(ids) == 4


def test_identify_prefers_an_exact_libdrm_name_over_a_family_name():
    ids = parse_amdgpu_ids(AMDGPU_IDS)
    assert identify("1002", "73ff", "c7", ids)[0] == "AMD Radeon RX 6600"
    # no revision: the family name, not a guess among revisions
    assert identify("1002", "73ff", None, ids)[0] == "AMD Radeon RX 6600 / 6600 XT / 6600M"
    # not in the table: libdrm's name (any revision), else a generic one
    name, model = identify("1002", "abcd", "c1", ids)
    assert name == "AMD Radeon Future, With Comma" and model is None
    assert identify("1002", "abce", None, ids)[0] == "AMD GPU 1002:abce"
    assert identify("10de", "2704", "a1")[0] == "NVIDIA GeForce RTX 4080"
    assert identify("8086", "56a5", "05")[0] == "Intel Arc A380"
    assert identify("1234", "1111", None)[0] == "GPU 1234:1111"


def test_sys_reader_tolerates_and_records(tmp_path):
    (tmp_path / "a").write_bytes(b"  0x1002 \n" + b"\0" * 4000)
    (tmp_path / "b").write_text("\n \t\n")
    (tmp_path / "c").write_text("twelve\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "kv").write_text('ID=steamos\nNAME="SteamOS"\nbroken line\n# comment\n')
    reader = SysReader(tmp_path)
    assert reader.read_int("/a") == 0x1002
    assert reader.read_text("/b") is None
    assert reader.read_int("/c") is None
    assert reader.read_text("/d") is None
    assert reader.read_text("/missing") is None
    assert reader.read_text("/missing2", required=True) is None
    assert reader.read_key_values("/kv", sep="=") == {"ID": "steamos", "NAME": "SteamOS"}
    assert reader.listdir("/nope") == []
    assert reader.problems == [
        "/b: empty",
        "/c: not a number: 'twelve'",
        "/d: is a directory, expected a file",
        "/missing2: missing",
    ]
    assert not reader.is_real_root


def test_parse_int():
    assert parse_int("0x73BF") == 0x73BF
    assert parse_int(" 42 ") == 42
    assert parse_int("4.2") is None and parse_int("") is None


@pytest.mark.parametrize(
    "file_name, targets",
    [
        ("TensileLibrary_lazy_gfx1030.dat", ["gfx1030"]),
        ("Kernels.so-000-gfx90a.hsaco", ["gfx90a"]),
        ("TensileLibrary_Type_HH_Contraction_gfx942_17.co", ["gfx942"]),
        ("TensileLibrary_gfx1151.co", ["gfx1151"]),
        ("gfx942:xnack-.co", ["gfx942"]),
        ("TensileManifest.txt", []),
        ("gfx10_notes", []),
    ],
)
def test_gfx_targets_in_rocblas_file_names(file_name, targets):
    assert GFX_IN_FILE_NAME.findall(file_name.lower()) == targets
