"""What kind of note a question is about, read from its form as well as its words.

Observers note what was seen (people, animals, text, colours, moving objects, cuts) and
transcripts note what was said. A question names its kind by a word ("who", "sign",
"colour") or by its form: what people should do, what will happen, when something starts or
closes, who introduced themselves, can only come from what was said, since nothing seen
tells the future or an instruction ("Where should visitors go?" shares no word with
`said: "please take the stairs on the left."`). A thing a question names that the observers
would report if they saw it (a dog, a car: the COCO classes) and that no note mentions was
not seen.
"""

from __future__ import annotations

import re

# the COCO detection classes and common names for them: things a viewer would report seeing
ANIMALS = frozenset(
    "animal animals pet pets cat cats kitten kittens dog dogs puppy puppies bird birds horse "
    "horses sheep cow cows elephant elephants bear bears zebra zebras giraffe giraffes".split())
OBJECTS = frozenset(
    "bicycle bicycles bike bikes car cars motorcycle motorcycles airplane airplanes aeroplane "
    "plane planes bus buses train trains truck trucks boat boats bench benches backpack "
    "umbrella umbrellas handbag suitcase frisbee skis snowboard kite bottle bottles cup cups "
    "fork knife spoon bowl banana bananas apple apples sandwich orange oranges pizza cake "
    "chair chairs couch sofa plant bed table toilet tv television laptop keyboard phone "
    "phones microwave oven toaster sink fridge refrigerator book books vase scissors "
    "toothbrush".split())
# what the motion tracker sees of any moving thing: a coloured object
MOVERS = frozenset("ball balls object objects shape shapes square squares thing things box "
                   "boxes block blocks".split())
CUES: dict[str, frozenset[str]] = {
    "speech": frozenset(
        "say said says saying speak spoke spoken talk talked talking announcement announce "
        "announced words voice speech hear heard mention mentioned tell told speaker "
        "speakers introduce introduced introduction called name named ask asked instructions "
        "instructed".split()),
    "people": frozenset(
        "who person people anyone anybody someone man woman men women face faces human "
        "humans somebody visitor visitors".split()),
    "cat": ANIMALS,
    "text": frozenset(
        "text written write writing sign signs read reads caption title label word words "
        "display displayed poster banner printed print marked notice".split()),
    "colour": frozenset(
        "colour color colours colors coloured colored hue hues shade tint".split()),
    "motion": frozenset(
        "move moving moved motion direction going travel travelled traveled crossing crossed "
        "cross roll rolled rolling drive drove driving heading headed went left right "
        "upwards downwards".split()) | MOVERS,
    "change": frozenset(
        "cut cuts scene scenes switch switched change changed changes happen happened "
        "events".split()),
}
# the forms of a question that nothing seen answers, only what was said or posted:
# instructions, plans, schedules
PLAN_FORMS = re.compile(
    r"\b(should|must|shall|supposed to|will|going to|need to|have to)\b"
    r"|\bwhen (does|do|is|are)\b|\b(until|by|at) what (hour|time)\b"
    r"|\bwhat time (does|do|is|are)\b|\bhow long (is|does|do|will)\b|\bhow late\b|\bdelay",
    re.I)
# ... and those about the words someone said: names, announcements
WORDS_FORMS = re.compile(
    r"\bintroduc|\bcalled\b|\bname\b|\bannounc|\bwhat did (he|she|they|the \w+) "
    r"(ask|want|need|say|mention|tell)", re.I)
# what the picture shows, by its look (not asked of what was said)
SEEN_FORMS = re.compile(r"\b(screen|picture|view|visible|seen|see|saw|shown|show|camera|"
                        r"appear|appeared|display|displayed|frame)\b", re.I)
WORD = re.compile(r"[a-z]+")
# a question asking what to do ("where should visitors go?") is answered by an instruction
INSTRUCTION_QUESTION = re.compile(
    r"\b(should|must|supposed to|need to|have to|has to|asked to|told to)\b", re.I)
# an instruction: a sentence that begins with "please" or a verb of what to do
IMPERATIVE = re.compile(
    r'^(said: ")?(please|kindly|do not|don\'t|never|always|take|go|use|turn|head|follow|'
    r"wait|come|keep|move|stay|leave|call|proceed|exit|walk|make|remember|bring|ask|stand|"
    r"sit|remain|report|return|check|avoid|mind)\b", re.I)


def asked_kinds(question: str) -> list[str]:
    """The kinds of note that answer `question`, the one it names most directly first: a
    plan or schedule is about speech and text (it is said or posted; text first when it
    names a display or sign), a question about someone's words is about speech (about text
    when it names a display or sign: "what did the sign say?"), whatever people it names;
    otherwise the kinds its words name. "left"/"right" alone do not make a question about
    motion when it names another kind ("the stairs on the left")."""
    words = set(WORD.findall(question.lower()))
    kinds = [name for name, cues in CUES.items() if words & cues]
    if plan_form(question):  # said or posted: the display first where named
        kinds = ["text", "speech"] if "text" in kinds else ["speech", "text"]
    elif words_form(question):  # a sign "says" too: "what did the sign say?" is its text
        kinds = ["text"] if "text" in kinds else ["speech"]
    elif "motion" in kinds and not words & (CUES["motion"] - {"left", "right"}):
        kinds.remove("motion")
    if kinds != ["change"] and "change" in kinds and not words & {"cut", "cuts", "scene",
                                                                  "scenes", "switch",
                                                                  "switched"}:
        kinds.remove("change")
    return kinds


def said_form(question: str) -> bool:
    """Whether only what was said (or posted) can answer `question`: instructions, plans,
    schedules, names, announcements."""
    return plan_form(question) or words_form(question)


def words_form(question: str) -> bool:
    """Whether `question` asks for someone's words: a name, an announcement, what was
    said."""
    return bool(WORDS_FORMS.search(question))


def plan_form(question: str) -> bool:
    """Whether `question` asks for an instruction, a plan or a schedule ("when does the
    store close?", "where should visitors go?")."""
    return bool(PLAN_FORMS.search(question))


def asks_what_to_do(question: str) -> bool:
    """Whether `question` asks what someone should do (an instruction answers it)."""
    return bool(INSTRUCTION_QUESTION.search(question))


def instruction(sentence: str) -> bool:
    """Whether `sentence` (or a note quoting it) tells someone what to do."""
    return bool(IMPERATIVE.search(sentence.strip()))


def seen_form(question: str) -> bool:
    """Whether `question` asks about what the picture showed ("on screen", "seen",
    "appear")."""
    return bool(SEEN_FORMS.search(question))


def named_things(question: str) -> list[str]:
    """The objects and animals `question` names (COCO classes and their common names), as
    written; not when it asks about what was said."""
    if said_form(question):
        return []
    words = WORD.findall(question.lower())
    return [w for w in words if w in OBJECTS or (w in ANIMALS and w not in
                                                  {"animal", "animals", "pet", "pets"})]


def article(noun: str) -> str:
    """'a dog', 'an airplane', 'any cars' for a plural."""
    if noun.endswith("s") and noun not in {"bus", "glass"}:
        return f"any {noun}"
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
