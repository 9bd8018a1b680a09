"""backends/ptxas_notes.py: ptxas's wgmma notes read from a verbose report (no GPU, no ptxas needed)."""

from mhattn.backends import ptxas_notes


def test_wgmma_notes_are_the_c75xx_lines_of_a_report():
    report = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 1280 by compiler to allow use of "
              "registers defined by GMMA in function 'k'\n"
              "ptxas info    : 112 bytes gmem\n"
              "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
              "program dependence on compiler-inserted WG.DP in divergent path in the function 'k'\n"
              "ptxas info    : Used 168 registers, used 16 barriers\n"
              "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    notes = ptxas_notes.wgmma_notes(report)
    assert len(notes) == 2
    assert notes[0].startswith("(C7517) warpgroup.wait is injected")
    assert notes[1].startswith("(C7518) Potential Performance Loss") and "serialized" in notes[1]


def test_a_report_without_notes_has_none():
    assert ptxas_notes.wgmma_notes("ptxas info    : Used 168 registers, used 16 barriers\n") == []
    assert ptxas_notes.wgmma_notes("") == []
