"""Skills: the released corpus, skills found in run folders, the leak check, index and exports."""

from mkb_eval.skills.corpus import read_corpus, render_release, write_release
from mkb_eval.skills.export import export as export_skills
from mkb_eval.skills.leak import Finding, check_text
from mkb_eval.skills.model import Outcome, Skill, SkillError
from mkb_eval.skills.runs import Run, read_run, run_skills

__all__ = ["Finding", "Outcome", "Run", "Skill", "SkillError", "check_text", "export_skills", "read_corpus",
           "read_run", "render_release", "run_skills", "write_release"]
