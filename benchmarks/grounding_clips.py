"""Clips for `python -m benchmarks grounding` drawn from a seed: other photos, voices,
colours and sentences each time, with three sets of questions per clip.

- "direct": asked in the words of the note that answers it;
- "paraphrase": the same facts asked in other words (no content word shares a stem with the
  note that answers it; `shared_stems` checks);
- "absent": about things that never happened in the clip (the right answer says so).

A clip is two to four scenes, each with one event drawn from: a spoken sentence with
numbers, times or a name; a printed sign; a person coming into view; a coloured square
crossing; a hard cut. Nothing here is chosen per seed by hand: `generated_clips(seed, n)`
makes new clips at will.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.grounding_questions import Clip, Question
from streamgrok.media.samples import Scene

PHOTOS = ("coffee", "rocket", "colorwheel", "moon", "coins", "brick", "grass", "gravel", "clock",
          None)
FIRST = PHOTOS[:3]  # in colour: the first cut is plain whatever comes next
VOICES = (("en-us", 150), ("en+m3", 140), ("en-gb", 170), ("en+f3", 160), ("en", 155))
NAMES = ("Oliver", "Maria", "Daniel", "Sophie", "James", "Laura", "Thomas", "Emma")
NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve "
                "thirteen fourteen fifteen sixteen seventeen eighteen nineteen").split()
TENS = {20: "twenty", 30: "thirty", 40: "forty", 50: "fifty"}
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 200), "green": (40, 170, 60),
           "yellow": (230, 210, 40)}
DIRECTIONS = {"left to right": (("left to right", "to the right", "rightwards"),),
              "right to left": (("right to left", "to the left", "leftwards"),),
              "downwards": (("down", "downwards", "top to bottom"),),
              "upwards": (("up", "upwards", "bottom to top"),)}
SIGNS = (  # caption, what it says (facts), a question in other words, what answers that
    ("EXIT 42", (("exit",), ("42",)), "Which way out was marked, and with what number?",
     (("exit", "way out"), ("42",))),
    ("PLATFORM 3", (("platform",), ("3",)), "Where do trains depart from, per the display?",
     (("platform",), ("3",))),
    ("NO PARKING", (("parking",),), "What is forbidden here, according to the display?",
     (("parking",),)),
    ("SALE 50%", (("sale",), ("50",)), "What offer did the display announce?",
     (("sale", "discount", "off"), ("50",))),
    ("ROOM 18", (("room",), ("18",)), "Which numbered place did the display show?",
     (("room",), ("18",))),
    ("OPEN 24 HOURS", (("open",), ("24",)), "How long does the business stay available?",
     (("24",),)),
)


def number_words(n: int) -> str:
    """0 <= n < 60 in words, as espeak-ng should say them."""
    if n < 20:
        return NUMBER_WORDS[n]
    tens, ones = divmod(n, 10)
    return TENS[tens * 10] + (f" {NUMBER_WORDS[ones]}" if ones else "")


@dataclass(frozen=True)
class Spoken:
    """One sentence and its questions: in its own words, in other words."""

    sentence: str
    direct: Question
    paraphrase: Question


def spoken(rng: random.Random) -> Spoken:
    """A sentence with a time, a number or a name, drawn with its questions."""
    kind = rng.randrange(6)
    if kind == 0:
        hour, minute = rng.randint(1, 11), rng.choice((15, 30, 45))
        room = rng.randint(2, 19)
        when = f"{hour}:{minute}"
        return Spoken(f"The meeting starts at {number_words(hour)} {number_words(minute)} "
                      f"in room {number_words(room)}.",
                      Question("When does the meeting start?", "speech", (("#" + when,),)),
                      Question("At what hour does the gathering begin?", "speech",
                               (("#" + when,),)))
    if kind == 1:
        side = rng.choice(("left", "right"))
        way = rng.choice(("stairs", "lift"))
        return Spoken(f"Please take the {way} on the {side}.",
                      Question(f"Which {way} should people take?", "speech", ((side,),)),
                      Question("Where should visitors go?", "speech", ((way,), (side,))))
    if kind == 2:
        gate = rng.randint(2, 19)
        return Spoken(f"Flight {number_words(rng.randint(2, 9))} boards at gate "
                      f"{number_words(gate)}.",
                      Question("Which gate does the flight board at?", "speech",
                               (("#" + str(gate),),)),
                      Question("Where should passengers of the plane wait?", "speech",
                               (("#" + str(gate),),)))
    if kind == 3:
        name = rng.choice(NAMES)
        return Spoken(f"Good morning. My name is {name}.",
                      Question("What name did the speaker say?", "speech", ((name.lower(),),)),
                      Question("Who introduced themselves?", "speech", ((name.lower(),),)))
    if kind == 4:
        hour = rng.randint(5, 11)
        shop = rng.choice(("store", "library", "bakery", "pharmacy"))
        return Spoken(f"The {shop} closes at {number_words(hour)} tonight.",
                      Question(f"When does the {shop} close?", "speech", (("#" + str(hour),),)),
                      Question("Until what hour can customers come in this evening?", "speech",
                               (("#" + str(hour),),)))
    minutes = rng.choice((10, 15, 20, 25, 30, 40))
    bus = rng.randint(2, 19)
    return Spoken(f"Bus {number_words(bus)} is running {number_words(minutes)} minutes late.",
                  Question("How many minutes late is the bus?", "speech",
                           (("#" + str(minutes),),)),
                  Question("How long is the delay?", "speech", (("#" + str(minutes),),)))


ABSENT = {  # what never happened -> questions about it
    "person": ("Was anyone on screen?", "Who walked into view?"),
    "text": ("What did the sign say?", "Was any writing displayed?"),
    "speech": ("What did the speaker say?", "Did anybody talk?"),
    "motion": ("Which way did the ball roll?", "Did anything cross the picture?"),
    "animal": ("What animal was on screen?", "Did a dog appear?"),
    "vehicle": ("Did a car drive past?", "Was a bicycle seen?"),
}


def generated_clip(rng: random.Random, index: int) -> Clip:
    """One clip of 2-4 scenes; each scene after the first begins with a hard cut (a new photo)
    unless it keeps the photo."""
    first = rng.choice(FIRST)
    photos = [first, *rng.sample([p for p in PHOTOS if p != first], 3)]
    kinds = rng.sample(("speech", "text", "person", "motion"), rng.randint(2, 3))
    scenes: list[Scene] = [Scene(photos[0], 3.0)]
    questions: list[Question] = []
    for n, kind in enumerate(kinds):
        photo = photos[n + 1] if kind != "motion" else None
        voice, speed = rng.choice(VOICES)
        if kind == "speech":
            said = spoken(rng)
            scenes.append(Scene(photo, 6.0, speech=said.sentence, voice=voice, speed=speed))
            pair, source = (said.direct, said.paraphrase), f'said: "{said.sentence}"'
        elif kind == "text":
            caption, facts, other, other_facts = rng.choice(SIGNS)
            scenes.append(Scene(photo, 4.0, caption=caption))
            pair = (Question("What text was shown on screen?", "text", facts),
                    Question(other, "text", other_facts))
            source = f'text on screen: "{caption}"'
        elif kind == "person":
            scenes.append(Scene(photo, 7.0, person_from=1.5, person_until=5.5))
            yes = (("yes", "person", "someone", "somebody", "man", "face", "people"),)
            pair = (Question("Was there a person on screen?", "presence", yes),
                    Question("Did anybody show up in the picture?", "presence", yes))
            source = "1 person appeared (1 in view); 1 face appeared (1 in view)"
        else:
            colour = rng.choice(tuple(COLOURS))
            direction = rng.choice(tuple(DIRECTIONS))
            scenes.append(Scene(None, 6.0, moving_square=True, mover_colour=COLOURS[colour],
                                mover_direction=direction))
            pair = (Question(f"Which way did the {colour} object move?", "colour/motion",
                             DIRECTIONS[direction]),
                    Question("What hue was the shape that crossed the picture?",
                             "colour/motion", ((colour,),)))
            source = f"the {colour} object is moving {direction}"
        questions += [pair[0].in_set("direct", source), pair[1].in_set("paraphrase", source)]
    cut_at = round(scenes[0].seconds)
    when = ((f"00:{cut_at:02d}", f"{cut_at} seconds", f"{cut_at} s"),)
    source = "scene cut: a different scene"
    questions += [Question("When was the first scene cut?", "change", when).in_set("direct",
                                                                                 source),
                  Question("At what moment did the picture first switch to another view?",
                           "change", when).in_set("paraphrase", source)]
    missing = [k for k in ("person", "text", "speech", "motion") if k not in kinds]
    missing += ["animal", "vehicle"]
    for kind in rng.sample(missing, min(3, len(missing))):
        questions.append(Question(rng.choice(ABSENT[kind]), "absent", absent=True,
                                  set="absent"))
    return Clip(f"gen{index}", scenes, questions)


def generated_clips(seed: int, count: int = 5) -> list[Clip]:
    """`count` clips drawn from `seed` (the same seed gives the same clips)."""
    rng = random.Random(seed)
    return [generated_clip(rng, i) for i in range(count)]


def fixed_clips() -> list[Clip]:
    """The benchmark's first five clips and their questions, written by hand (the "existing"
    set; the events are known because they are drawn here)."""
    grey = (None,)
    return [
        Clip("announcement", [
            Scene(*grey, 2.0),
            Scene(*grey, 6.0, speech="Attention please. The delivery truck arrives at gate "
                  "seven.", voice="en-us", speed=150),
            Scene("coffee", 4.0, caption="GATE 7"),
        ], [
            Question("What did the announcement say?", "speech",
                     (("truck",), ("gate",))),
            Question("Which gate does the truck arrive at?", "speech", (("7", "seven"),)),
            Question("What text was shown on screen?", "text", (("gate",),)),
            Question("Was there a person on screen?", "presence", absent=True),
            Question("When did the scene change?", "change", (("00:08", "8 s", "8 seconds"),)),
        ]),
        Clip("visitor", [
            Scene("coffee", 4.0),
            Scene(*grey, 8.0, person_from=2.0, person_until=6.0,
                  speech="Good morning. My name is Oliver.", speech_at=2.5, voice="en+m3",
                  speed=140),
        ], [
            Question("Who appeared on screen?", "presence", (("person", "face", "man",
                                                              "someone", "oliver"),)),
            Question("What name did the speaker say?", "speech", (("oliver",),)),
            Question("When did the person appear?", "change",
                     (("00:06", "00:07", "6 seconds", "7 seconds"),)),
            Question("How many people were in view at most?", "counting", (("1", "one"),)),
            Question("Was a cat seen?", "presence", absent=True),
        ]),
        Clip("cuts", [
            Scene("astronaut", 4.0),
            Scene("coffee", 4.0),
            Scene("rocket", 4.0, speech="This is the third scene.", voice="en+f3", speed=170),
        ], [
            Question("How many scene cuts were there?", "counting", (("2", "two"),)),
            Question("When was the first scene cut?", "change", (("00:04", "4 seconds"),)),
            Question("What did the voice say?", "speech", (("third",), ("scene",))),
            Question("What colours were seen?", "colour/motion",
                     (("grey", "brown", "beige", "white", "black", "orange", "blue"),)),
            Question("Was any text shown on screen?", "text", absent=True),
        ]),
        Clip("ball", [
            Scene(*grey, 6.0, moving_square=True, mover_colour=(40, 80, 200),
                  mover_direction="right to left"),
            Scene(*grey, 6.0, moving_square=True, mover_colour=(230, 210, 40),
                  mover_direction="left to right", speech="Watch the yellow one.",
                  voice="en", speed=160),
        ], [
            Question("What colour was the first moving object?", "colour/motion",
                     (("blue",),)),
            Question("Which way did the blue object move?", "colour/motion",
                     (("right to left", "to the left", "leftwards"),)),
            Question("Which way did the yellow object move?", "colour/motion",
                     (("left to right", "to the right", "rightwards"),)),
            Question("How many moving objects appeared?", "counting", (("2", "two"),)),
            Question("What did the speaker say?", "speech", (("yellow",),)),
        ]),
        Clip("shop", [
            Scene("astronaut", 4.0, caption="OPEN 24 HOURS"),
            Scene(*grey, 7.0, speech="The store closes at nine tonight. Please come back "
                  "tomorrow.", voice="en-gb", speed=180),
        ], [
            Question("What did the sign say?", "text", (("open",), ("24", "hours"))),
            Question("When does the store close?", "speech", (("nine", "9"),)),
            Question("Who was on screen at the start?", "presence",
                     (("person", "face", "man", "someone", "astronaut"),)),
            Question("How many faces were seen?", "counting", (("1", "one"),)),
            Question("When did the sign disappear?", "change", (("00:04", "4 seconds"),)),
        ]),
    ]
